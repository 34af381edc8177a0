"""Split encoding in the scheduler (pure Python, hand-made runner outputs): an item whose tower runs in stages and
does not fit the step's encoder budget is encoded a slice of stages per step, its request's prefill waits before it
until the last slice, running requests keep decoding, and an abandoned item leaves nothing behind."""

from tests.core.test_scheduler import add, fake_run, make_sched, run_to_end
from vlserve.multimodal.inputs import MultiModalFeature

IMG, STAGES = 256, 8  # a stage costs IMG / STAGES = 32 embeddings


def _sched(budget, stages=STAGES, **kw):
    return make_sched(
        num_blocks=512,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        encoder_cache_size=1024,
        encoder_compute_budget=budget,
        enable_prefix_caching=False,
        encoder_stage_counts={"image": stages} if stages else {},
        **kw,
    )


def _image_request(s, rid, mm_hash="img", offset=10, max_tokens=3):
    add(s, rid, offset + IMG + 20, max_tokens=max_tokens, mm=[MultiModalFeature("image", mm_hash, offset, IMG)])


def _step(s):
    so = s.schedule()
    s.update_from_output(so, fake_run(s, so))
    s.check_integrity()
    return so


def _slices(so):
    return [(rid, p.mm_hash, p.start, p.end) for rid, ps in so.scheduled_encoder_slices.items() for p in ps]


def test_item_over_budget_runs_a_slice_per_step_while_text_decodes():
    s = _sched(budget=64)  # two stages per step
    add(s, "text", 5, max_tokens=40)
    _step(s)
    _image_request(s, "a")
    steps = [_step(s) for _ in range(5)]
    assert [_slices(so) for so in steps[:4]] == [[("a", "img", i, i + 2)] for i in (0, 2, 4, 6)]
    assert all(so.num_scheduled_tokens["text"] == 1 for so in steps)  # a token for the text stream every step
    assert steps[0].num_scheduled_tokens["a"] == 10  # the text before the item, then nothing until it is encoded
    assert all("a" not in so.num_scheduled_tokens for so in steps[1:3])
    assert steps[3].num_scheduled_tokens["a"] == IMG + 20  # the last slice shares its step with the item's tokens
    assert not steps[3].scheduled_encoder_inputs and s.encoder_cache.partial == {}
    assert not steps[4].scheduled_encoder_slices
    run_to_end(s)


def test_without_stages_an_item_over_budget_runs_whole():
    s = _sched(budget=64, stages=0)
    _image_request(s, "a")
    so = _step(s)
    assert so.scheduled_encoder_inputs == {"a": [0]} and not so.scheduled_encoder_slices
    run_to_end(s)


def test_item_within_budget_is_not_split():
    s = _sched(budget=IMG)
    _image_request(s, "a")
    so = _step(s)
    assert so.scheduled_encoder_inputs == {"a": [0]} and not so.scheduled_encoder_slices


def test_tiny_budget_runs_one_stage_per_step_and_an_item_at_the_window_start_is_admitted_with_no_token():
    s = _sched(budget=1)
    _image_request(s, "a", offset=0)
    steps = [_step(s) for _ in range(STAGES)]
    assert [_slices(so) for so in steps] == [[("a", "img", i, i + 1)] for i in range(STAGES)]
    assert all(not so.num_scheduled_tokens for so in steps[:-1])
    assert steps[0].scheduled_new_reqs[0].req_id == "a" and not steps[0].is_empty
    assert steps[-1].num_scheduled_tokens["a"] == IMG + 20
    run_to_end(s)


def test_another_request_with_the_same_item_waits_then_reuses_it():
    s = _sched(budget=64)  # two stages per step
    _image_request(s, "a")
    _step(s)
    _image_request(s, "b")
    so = _step(s)  # a's second slice; b waits before the partial item (no second encode of it)
    assert _slices(so) == [("a", "img", 2, 4)] and so.num_scheduled_tokens["b"] == 10
    so = _step(s)
    assert _slices(so) == [("a", "img", 4, 6)] and "b" not in so.num_scheduled_tokens
    so = _step(s)  # a's last slice runs before this step's forward: b reuses the item in the same step
    assert _slices(so) == [("a", "img", 6, 8)] and so.num_scheduled_tokens["b"] == IMG + 20
    run_to_end(s)
    assert s.encoder_cache.misses == 1 and s.encoder_cache.hits == 1


def test_abort_mid_encode_frees_the_partial_entry_and_tells_the_runner():
    s = _sched(budget=64)
    add(s, "text", 5, max_tokens=40)
    _image_request(s, "a")
    _step(s)
    _step(s)
    assert s.encoder_cache.partial == {"img": 4}
    s.abort_requests(["a"])
    assert s.encoder_cache.partial == {} and not s.encoder_cache.has("img")
    assert s.encoder_cache.num_free == s.encoder_cache.cache_size  # its space is back
    so = _step(s)
    assert so.free_encoder_mm_hashes == ["img"] and "a" in so.finished_req_ids
    s.abort_requests(["text"])
    s.schedule()
    s.check_integrity()  # idle: no KV block, encoder reference or partial entry left
    assert not s.kv.req_to_blocks and not s.encoder_cache.cached


def test_preempted_mid_encode_starts_over_and_finishes():
    s = _sched(budget=64)
    _image_request(s, "a", max_tokens=2)
    _step(s)
    assert s.encoder_cache.partial == {"img": 2}
    s._preempt(s.running.pop())  # as the running loop does when the pool runs out
    assert s.encoder_cache.partial == {} and not s.encoder_cache.has("img")
    so = _step(s)
    assert so.free_encoder_mm_hashes == ["img"] and _slices(so) == [("a", "img", 0, 2)]
    outs, _ = run_to_end(s)
    assert len(outs["a"]) == 2


def test_the_same_item_twice_in_a_prompt_is_split_once():
    s = _sched(budget=128)  # four stages per step
    first, second = MultiModalFeature("image", "img", 10, IMG), MultiModalFeature("image", "img", 300, IMG)
    add(s, "a", 600, max_tokens=2, mm=[first, second])
    steps = [_step(s) for _ in range(2)]
    assert [_slices(so) for so in steps] == [[("a", "img", 0, 4)], [("a", "img", 4, 8)]]
    assert steps[1].num_scheduled_tokens["a"] == 600 - 10  # both runs of the item go in with its last slice
    run_to_end(s)
    assert s.encoder_cache.misses == 1


def test_an_item_over_the_budget_takes_what_is_left_of_it_after_a_whole_item():
    s = _sched(budget=IMG - 32)  # seven stages a step: the 256-embedding item cannot run whole in any step
    add(s, "small", 10 + 64 + 5, max_tokens=2, mm=[MultiModalFeature("image", "small-img", 10, 64)])
    _image_request(s, "a")
    so = _step(s)
    assert so.scheduled_encoder_inputs == {"small": [0]}
    assert _slices(so) == [("a", "img", 0, 5)]  # 160 embeddings left: five of its eight 32-embedding stages
    run_to_end(s)


def test_an_item_that_fits_a_step_waits_for_the_next_one_instead_of_being_sliced():
    s = _sched(budget=IMG)
    add(s, "small", 10 + 64 + 5, max_tokens=2, mm=[MultiModalFeature("image", "small-img", 10, 64)])
    _image_request(s, "a")
    first = _step(s)
    assert first.scheduled_encoder_inputs == {"small": [0]} and _slices(first) == []
    assert first.num_scheduled_tokens["a"] == 10  # its text up to the image
    second = _step(s)
    assert second.scheduled_encoder_inputs == {"a": [0]} and _slices(second) == []  # whole, in one step
    run_to_end(s)
    assert s.encoder_cache.misses == 2


def test_a_lone_slice_takes_a_third_of_the_item_within_the_slice_cap():
    s = _sched(budget=32)  # one 32-embedding stage a step by the budget alone
    s.set_encoder_budget(32, slice_cap=1000)
    _image_request(s, "a")
    assert _slices(_step(s)) == [("a", "img", 0, 3)]  # ceil(8 / 3) stages: the item in three steps, not eight
    assert _slices(_step(s)) == [("a", "img", 3, 6)]
    assert _slices(_step(s)) == [("a", "img", 6, 8)]
    run_to_end(s)
    capped = _sched(budget=32)
    capped.set_encoder_budget(32, slice_cap=64)  # a second's worth is two stages here
    _image_request(capped, "a")
    assert _slices(_step(capped)) == [("a", "img", 0, 2)]
    run_to_end(capped)
    plain = _sched(budget=32)  # no cap measured: one stage a step, as before
    _image_request(plain, "a")
    assert _slices(_step(plain)) == [("a", "img", 0, 1)]
    run_to_end(plain)
