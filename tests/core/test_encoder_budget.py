"""The per-step encoder budget: the scheduler's admission rule (hand-made runner outputs, no torch) and the
adaptive `EncoderBudget` that sizes it from measured timings."""

import pytest

from tests.core.test_scheduler import add, fake_run, make_sched, run_to_end
from vlserve.core.encoder_budget import EncoderBudget
from vlserve.multimodal.inputs import MultiModalFeature

IMG = 256  # embeddings per image


def _image_request(s, rid, n_embeds=IMG, offset=10, max_tokens=3):
    """A prompt of `offset` text tokens, the image's placeholders, then 20 text tokens."""
    add(
        s,
        rid,
        offset + n_embeds + 20,
        max_tokens=max_tokens,
        mm=[MultiModalFeature("image", f"hash-{rid}", offset, n_embeds)],
    )


def _burst_sched(budget, cache=4096, **kw):
    """Prefix caching off: the test prompts share their text, and hits would blur the token counts checked."""
    return make_sched(
        num_blocks=2048,
        max_model_len=1024,
        max_num_batched_tokens=4096,
        encoder_cache_size=cache,
        encoder_compute_budget=budget,
        enable_prefix_caching=False,
        **kw,
    )


def _run_burst(s, num_images, text_tokens=40):
    """A text request decoding, then a burst of image requests; runs to the end. Returns per step (items encoded,
    tokens the text request computed) for the steps after the burst arrived."""
    add(s, "text", 5, max_tokens=text_tokens)
    so = s.schedule()  # the text request's prefill
    s.update_from_output(so, fake_run(s, so))
    for i in range(num_images):
        _image_request(s, f"img{i}")
    steps = []
    while s.has_unfinished_requests():
        so = s.schedule()
        steps.append(
            (sum(len(v) for v in so.scheduled_encoder_inputs.values()), so.num_scheduled_tokens.get("text", 0))
        )
        s.update_from_output(so, fake_run(s, so))
        s.check_integrity()
    s.check_integrity()  # idle: no KV block and no encoder-cache reference left
    assert s.encoder_cache.misses == num_images
    return steps


def test_budget_one_encodes_one_image_per_step_while_text_decodes():
    s = _burst_sched(budget=1)
    steps = _run_burst(s, num_images=4)
    assert [n for n, _ in steps[:4]] == [1, 1, 1, 1]  # one image per step, not all four in the first
    assert all(t == 1 for _, t in steps[:4])  # the running request decoded in every one of those steps
    assert sum(n for n, _ in steps) == 4


def test_budget_600_encodes_two_images_per_step():
    s = _burst_sched(budget=600)  # 2 x 256 fits, 3 x 256 does not
    steps = _run_burst(s, num_images=5)
    assert [n for n, _ in steps[:3]] == [2, 2, 1]
    assert all(t == 1 for _, t in steps[:3])


def test_cut_request_keeps_its_text_and_waits_for_its_image():
    s = _burst_sched(budget=1)
    _image_request(s, "a")
    _image_request(s, "b", offset=12)
    so = s.schedule()
    # a's image is the step's first item; b runs only the text before its image, then waits in running.
    assert so.scheduled_encoder_inputs == {"a": [0]}
    assert so.num_scheduled_tokens == {"a": 10 + IMG + 20, "b": 12}
    s.update_from_output(so, fake_run(s, so))
    assert s.requests["b"].num_computed_tokens == 12
    so = s.schedule()
    assert so.scheduled_encoder_inputs == {"b": [0]} and so.num_scheduled_tokens["b"] == IMG + 20
    s.update_from_output(so, fake_run(s, so))
    run_to_end(s)


def test_item_larger_than_budget_runs_alone_in_its_step():
    s = _burst_sched(budget=100)
    _image_request(s, "big", n_embeds=IMG)
    _image_request(s, "small1", n_embeds=40)
    _image_request(s, "small2", n_embeds=40)
    encoded = []
    while s.has_unfinished_requests():
        so = s.schedule()
        encoded.append(sorted(so.scheduled_encoder_inputs))
        s.update_from_output(so, fake_run(s, so))
    assert encoded[:2] == [["big"], ["small1", "small2"]]  # 256 alone; then 40 + 40 within 100
    s.check_integrity()


def test_small_item_first_then_big_one_waits_for_the_next_step():
    s = _burst_sched(budget=100)
    _image_request(s, "small", n_embeds=40)
    _image_request(s, "big", n_embeds=IMG)
    so = s.schedule()
    assert so.scheduled_encoder_inputs == {"small": [0]} and so.num_scheduled_tokens["big"] == 10
    s.update_from_output(so, fake_run(s, so))
    so = s.schedule()
    assert so.scheduled_encoder_inputs == {"big": [0]}
    s.update_from_output(so, fake_run(s, so))
    run_to_end(s)


def test_item_larger_than_the_cache_is_refused_but_not_one_over_the_budget():
    s = _burst_sched(budget=8, cache=200)
    with pytest.raises(ValueError, match="encoder_cache_size"):
        _image_request(s, "huge", n_embeds=IMG)
    assert not s.has_unfinished_requests()
    _image_request(s, "fits", n_embeds=150)  # over the per-step budget, within the cache: admitted
    run_to_end(s)


def test_budget_under_chunked_prefill_prefix_hits_and_preemption():
    """Two images per request, small token chunks, a KV pool that forces preemption, then the same prompts again
    (prefix and encoder cache hits): at most one item per step at budget 1, everything finishes, nothing leaks."""
    s = make_sched(
        num_blocks=60, max_model_len=256, max_num_batched_tokens=32, encoder_cache_size=64, encoder_compute_budget=1
    )

    def two_images(rid, tag):
        add(
            s,
            rid,
            100,
            max_tokens=12,
            mm=[MultiModalFeature("image", f"{tag}-0", 8, 24), MultiModalFeature("image", f"{tag}-1", 50, 24)],
        )

    add(s, "text", 4, max_tokens=30)
    for i in range(3):
        two_images(f"r{i}", f"h{i}")
    per_step = []
    while s.has_unfinished_requests():
        so = s.schedule()
        per_step.append(sum(len(v) for v in so.scheduled_encoder_inputs.values()))
        s.update_from_output(so, fake_run(s, so))
        s.check_integrity()
    assert max(per_step) == 1
    assert s.stats.num_preemptions > 0
    s.check_integrity()
    misses = s.encoder_cache.misses
    two_images("again", "h2")  # the last request's prompt: prefix hits, its images still cached
    run_to_end(s)
    assert s.kv.prefix_hits > 0 and s.encoder_cache.misses == misses


def test_prefix_hit_into_an_evicted_image_waits_for_its_own_step():
    """A prompt whose prefix hit ends inside an image that the encoder cache evicted must encode it again; when
    another item took the step's budget, it is not admitted (its window would end before its hit) and runs next."""
    s = make_sched(num_blocks=128, max_model_len=256, encoder_cache_size=30, encoder_compute_budget=1)

    def req(rid, mm_hash):
        add(s, rid, 40, max_tokens=2, mm=[MultiModalFeature("image", mm_hash, 8, 30)])  # placeholders 8..37

    req("a", "x")
    run_to_end(s)
    req("b", "y")  # evicts x (the cache holds one image)
    run_to_end(s)
    req("c", "z")
    req("a2", "x")
    so = s.schedule()
    assert so.scheduled_encoder_inputs == {"c": [0]} and "a2" not in so.num_scheduled_tokens
    s.update_from_output(so, fake_run(s, so))
    so = s.schedule()
    assert so.scheduled_encoder_inputs == {"a2": [0]}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 36 and so.num_scheduled_tokens["a2"] == 4
    s.update_from_output(so, fake_run(s, so))
    run_to_end(s)


def test_set_encoder_budget_applies_from_the_next_step():
    s = _burst_sched(budget=1)
    for i in range(3):
        _image_request(s, f"i{i}")
    so = s.schedule()
    assert len(so.scheduled_encoder_inputs) == 1
    s.update_from_output(so, fake_run(s, so))
    s.set_encoder_budget(2 * IMG)
    so = s.schedule()
    assert len(so.scheduled_encoder_inputs) == 2
    s.update_from_output(so, fake_run(s, so))
    with pytest.raises(ValueError):
        s.set_encoder_budget(0)
    run_to_end(s)


def test_items_after_a_steps_first_join_it_only_within_the_pack_budget():
    """A burst of small images with a budget of three but a pack budget of one: one image a step (each request's
    first token a step after the previous one's), not three in one step; an item as long as the budget still runs
    alone in its step."""
    s = _burst_sched(budget=3 * IMG)
    s.set_encoder_budget(3 * IMG, pack=IMG + IMG // 2)
    steps = _run_burst(s, num_images=4)
    assert [n for n, _ in steps[:4]] == [1, 1, 1, 1]
    assert all(t == 1 for _, t in steps[:4])  # the running request decoded in every one of those steps
    s = _burst_sched(budget=3 * IMG)
    s.set_encoder_budget(3 * IMG, pack=2 * IMG)  # two fit the pack: two a step
    assert [n for n, _ in _run_burst(s, num_images=4)[:2]] == [2, 2]
    big = _burst_sched(budget=3 * IMG)
    big.set_encoder_budget(3 * IMG, pack=IMG // 2)  # the first item of a step is never held to the pack
    _image_request(big, "big", n_embeds=3 * IMG)
    so = big.schedule()
    assert list(so.scheduled_encoder_inputs.values()) == [[0]]
    big.update_from_output(so, fake_run(big, so))
    run_to_end(big)


# -- EncoderBudget ---------------------------------------------------------------------------------------------
def test_adaptive_budget_is_one_until_both_timings_are_measured():
    b = EncoderBudget()
    assert b.budget == 1
    assert b.observe(0.5, 250, 0.6, is_decode=False) == 1  # seconds per embedding known, decode step not yet
    assert b.observe(0.0, 0, 3.0, is_decode=False) == 1  # a text prefill does not time a decode step
    assert b.decode_step_seconds is None
    assert b.observe(0.0, 0, 0.02) == 10  # 0.02 s / (0.5 s / 250) = 10 embeddings


def test_a_step_that_decodes_and_encodes_times_both():
    """In a burst of images every step encodes: its seconds less its encoder seconds time the decode step, so the
    budget grows past 1 without waiting for a step that encodes nothing."""
    b = EncoderBudget()
    assert b.observe(0.5, 250, 0.52) == 10  # 2 ms per embedding, a 20 ms decode step beside it
    assert b.decode_step_seconds == pytest.approx(0.02)
    assert b.observe(0.5, 250, 0.5) == 10  # no time beyond the encoder's: no decode sample


def test_adaptive_budget_follows_moving_averages():
    b = EncoderBudget(smoothing=0.5)
    b.observe(0.0, 0, 0.010)  # decode step 10 ms
    assert b.observe(0.1, 100, 0.2, is_decode=False) == 10  # 1 ms per embedding -> 10
    assert b.observe(0.0, 0, 0.030) == 20  # decode average 20 ms
    assert b.observe(0.3, 100, 0.4, is_decode=False) == 10  # per embedding (1 + 3) / 2 = 2 ms
    assert b.observe(2e-9, 1000, 0.1, is_decode=False) == 20  # per embedding ~1 ms
    assert b.observe(0.0, 0, 1e-9) >= 1  # never below one embedding
    tiny = EncoderBudget()
    tiny.observe(10.0, 1, 11.0, is_decode=False)  # 10 s per embedding
    assert tiny.observe(0.0, 0, 0.001) == 1


def test_fixed_budget_is_never_adapted():
    b = EncoderBudget(fixed=300)
    for args in ((0.5, 250, 0.6), (0.0, 0, 0.001), (0.0, 0, 100.0)):
        assert b.observe(*args) == 300
    with pytest.raises(ValueError):
        EncoderBudget(fixed=0)


def test_a_floor_of_step_time_lets_images_share_steps():
    """`min_step_seconds` (the engine's encoder_step_ms): with decode steps shorter than the floor, a step may
    encode the floor's worth of embeddings; with longer decode steps, the decode step rules as before."""
    b = EncoderBudget(min_step_seconds=0.1)
    assert b.observe(0.5, 250, 0.6, is_decode=False) == 50  # 2 ms per embedding: 0.1 s of them, no decode yet
    assert b.observe(0.0, 0, 0.01) == 50  # a 10 ms decode step: the floor is longer
    slow = EncoderBudget(min_step_seconds=0.1, smoothing=1.0)
    slow.observe(0.5, 250, 0.6, is_decode=False)
    assert slow.observe(0.0, 0, 0.4) == 200  # a 400 ms decode step: longer than the floor
    assert EncoderBudget(min_step_seconds=0.0).observe(0.5, 250, 0.6, is_decode=False) == 1  # no floor: as before
    with pytest.raises(ValueError):
        EncoderBudget(min_step_seconds=-1.0)


def test_the_pack_budget_is_one_decode_step():
    b = EncoderBudget(min_step_seconds=0.15, smoothing=1.0)
    assert b.pack == b.budget == 1  # nothing measured yet
    b.observe(0.5, 250, 0.6, is_decode=False)  # 2 ms per embedding, no decode step timed yet
    assert (b.budget, b.pack) == (75, 1)  # 150 ms of tower work; later items only as far as one embedding
    b.observe(0.0, 0, 0.01)  # a 10 ms decode step
    assert (b.budget, b.pack) == (75, 5)
    b.observe(0.0, 0, 0.4)  # a 400 ms decode step: both follow it
    assert (b.budget, b.pack) == (200, 200)
    fixed = EncoderBudget(fixed=300)
    fixed.observe(0.5, 250, 0.6)
    assert fixed.pack == 300  # a budget the user set packs as before


def test_the_slice_cap_is_about_a_second_of_measured_tower_work():
    b = EncoderBudget(min_step_seconds=0.15)
    assert b.slice_cap == 0  # nothing measured yet
    b.observe(0.5, 250, 0.6, is_decode=False)  # 2 ms per embedding
    assert b.slice_cap == 500  # 1 s of it
    half = EncoderBudget(max_slice_seconds=0.5)
    half.observe(0.5, 250, 0.6, is_decode=False)
    assert half.slice_cap == 250
    fixed = EncoderBudget(fixed=300)
    fixed.observe(0.5, 250, 0.6)
    assert fixed.slice_cap == 0  # a budget the user set is used as is: no floor past it


def test_encoder_step_ms_is_validated():
    from vlserve.config import EngineArgs

    for bad in (-5, "fast", True, float("nan")):
        with pytest.raises(ValueError, match="encoder_step_ms"):
            EngineArgs(model="x", encoder_step_ms=bad)
