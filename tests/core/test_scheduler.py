"""Scheduler unit tests with hand-made runner outputs (no model, no torch)."""

import pytest

from vlserve.config import SchedulerConfig
from vlserve.core.request import EngineCoreRequest
from vlserve.core.sched_output import ModelRunnerOutput
from vlserve.core.scheduler import Scheduler
from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.sampling_params import SamplingParams


def make_sched(num_blocks=64, **kw):
    cfg = SchedulerConfig(
        **{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256, "block_size": 4, **kw}
    )
    return Scheduler(cfg, num_blocks)


def add(s, rid, n_prompt, max_tokens=4, mm=None, **params):
    s.add_request(
        EngineCoreRequest(
            rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, **params), 0.0, mm or []
        )
    )


def fake_run(s, so, token=7):
    """A runner that samples `token` for each request whose window reached its last known token."""
    ids, toks = [], []
    for rid, _n in so.num_scheduled_tokens.items():
        req = s.requests[rid]
        ids.append(rid)
        toks.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(ids, toks)


def run_to_end(s, max_steps=500, token=7):
    outs, steps = {}, []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        steps.append(dict(so.num_scheduled_tokens))
        for o in s.update_from_output(so, fake_run(s, so, token)):
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                outs[o.request_id + ":reason"] = o.finish_reason
        s.check_integrity()
    assert not s.has_unfinished_requests()
    s.check_integrity()
    return outs, steps


def test_prefill_then_decode_until_max_tokens():
    s = make_sched()
    add(s, "a", 10, max_tokens=3)
    outs, steps = run_to_end(s)
    assert steps == [{"a": 10}, {"a": 1}, {"a": 1}]
    assert outs["a"] == [7, 7, 7] and outs["a:reason"] == "length"
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks


def test_chunked_prefill_splits_and_mixes_with_decode():
    s = make_sched(max_num_batched_tokens=4)
    add(s, "a", 2, max_tokens=4)
    add(s, "b", 9, max_tokens=1)
    outs, steps = run_to_end(s)
    assert steps[0] == {"a": 2, "b": 2}
    assert steps[1] == {"a": 1, "b": 3}  # a decodes while b prefills
    assert sum(st.get("b", 0) for st in steps) == 9
    assert outs["b"] == [7] and len(outs["a"]) == 4


def test_max_num_seqs_bounds_running():
    s = make_sched(max_num_seqs=2)
    for i in range(5):
        add(s, f"r{i}", 3, max_tokens=2)
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    s.update_from_output(so, fake_run(s, so))
    run_to_end(s)


def test_preemption_recomputes_and_finishes():
    # 6 blocks of 4 tokens = 24 slots; two requests that each grow to 16 tokens cannot both fit.
    s = make_sched(num_blocks=6, enable_prefix_caching=False)
    add(s, "a", 8, max_tokens=8)
    add(s, "b", 8, max_tokens=8)
    outs, _ = run_to_end(s)
    assert s.stats.num_preemptions >= 1
    assert outs["a"] == [7] * 8 and outs["b"] == [7] * 8


def test_stop_token_min_tokens_and_ignore_eos():
    s = make_sched()
    add(s, "stop", 3, max_tokens=10, stop_token_ids=[7])
    add(s, "min", 3, max_tokens=10, stop_token_ids=[7], min_tokens=3)
    outs, _ = run_to_end(s)
    assert outs["stop"] == [7] and outs["stop:reason"] == "stop"
    assert outs["min"] == [7, 7, 7] and outs["min:reason"] == "stop"


def test_eos_stops_unless_ignored():
    s = make_sched()
    for rid, ignore in (("eos", False), ("ign", True)):
        p = SamplingParams(max_tokens=5, ignore_eos=ignore, _eos_token_ids=(7,))
        s.add_request(EngineCoreRequest(rid, [1, 2, 3], p, 0.0))
    outs, _ = run_to_end(s)
    assert outs["eos"] == [7] and outs["ign"] == [7] * 5


def test_abort_frees_everything():
    s = make_sched()
    add(s, "a", 10)
    add(s, "b", 10)
    so = s.schedule()
    s.update_from_output(so, fake_run(s, so))
    assert s.abort_requests(["a", "b", "missing"]) == ["a", "b"]
    s.check_integrity()
    assert s.schedule().finished_req_ids == {"a", "b"}


def test_prefix_hit_skips_cached_tokens():
    s = make_sched()
    add(s, "a", 12, max_tokens=1)
    run_to_end(s)
    add(s, "b", 12, max_tokens=1)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"b": 4}  # 8 of 12 prompt tokens hit (the last block always recomputes)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    s.update_from_output(so, fake_run(s, so))
    run_to_end(s)


@pytest.mark.parametrize("n_prompt,error", [(0, "empty"), (256, "max_model_len"), (300, "max_model_len")])
def test_bad_prompts_rejected(n_prompt, error):
    s = make_sched()
    with pytest.raises(ValueError, match=error):
        add(s, "x", n_prompt)
    assert not s.has_unfinished_requests()


def test_duplicate_request_id_rejected():
    s = make_sched()
    add(s, "x", 3)
    with pytest.raises(ValueError, match="already"):
        add(s, "x", 3)


def _image(h, off, n):
    return MultiModalFeature("image", h, off, n)


def test_encoder_inputs_scheduled_when_window_reaches_them():
    s = make_sched(max_num_batched_tokens=8, encoder_cache_size=32, encoder_compute_budget=32)
    add(s, "a", 20, max_tokens=1, mm=[_image("img1", 4, 10)])
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 8}
    assert so.scheduled_encoder_inputs == {"a": [0]}
    s.update_from_output(so, fake_run(s, so))
    so = s.schedule()  # second chunk covers the rest of the image: no second encoder run
    assert so.scheduled_encoder_inputs == {}
    s.update_from_output(so, fake_run(s, so))
    run_to_end(s)
    assert s.encoder_cache.misses == 1


def test_identical_images_encoded_once_across_requests():
    s = make_sched(encoder_cache_size=32, encoder_compute_budget=32)
    for i in range(4):
        add(s, f"r{i}", 20, max_tokens=2, mm=[_image("same", 2, 10)])
    so = s.schedule()
    assert sum(len(v) for v in so.scheduled_encoder_inputs.values()) == 1
    s.update_from_output(so, fake_run(s, so))
    run_to_end(s)


def test_unaffordable_item_cuts_window_to_text_before_it():
    s = make_sched(encoder_cache_size=16, encoder_compute_budget=16)
    add(s, "a", 30, max_tokens=1, mm=[_image("i1", 2, 10)])
    add(s, "b", 30, max_tokens=1, mm=[_image("i2", 5, 10)])
    so = s.schedule()
    # Only one 10-embedding item fits in a 16-embedding budget: b runs only the text before its image.
    assert so.num_scheduled_tokens == {"a": 30, "b": 5}
    assert so.scheduled_encoder_inputs == {"a": [0]}
    s.update_from_output(so, fake_run(s, so))
    run_to_end(s)


def test_item_larger_than_encoder_cache_rejected_at_admission():
    s = make_sched(encoder_cache_size=8, encoder_compute_budget=8)
    with pytest.raises(ValueError, match="embeddings"):
        add(s, "a", 30, mm=[_image("big", 2, 10)])
    assert not s.has_unfinished_requests()


def test_encoder_refs_released_after_kv_written():
    s = make_sched(encoder_cache_size=32, encoder_compute_budget=32)
    add(s, "a", 20, max_tokens=3, mm=[_image("x", 2, 10)])
    so = s.schedule()
    s.update_from_output(so, fake_run(s, so))
    entry_refs = s.encoder_cache.num_references("x") if hasattr(s.encoder_cache, "num_references") else None
    if entry_refs is not None:
        assert entry_refs == 0
    run_to_end(s)
    s.encoder_cache.check_integrity()


def test_encoder_planning_is_a_pure_query():
    """Planning a window (explicit start) references, evicts and moves nothing; committing does."""
    s = make_sched(encoder_cache_size=16, encoder_compute_budget=32)
    add(s, "a", 20, max_tokens=1, mm=[_image("old", 2, 10)])
    run_to_end(s)  # "old" is now freeable
    add(s, "b", 30, max_tokens=1, mm=[_image("new", 2, 10), _image("old", 16, 10)])
    req = s.requests["b"]
    plan, num_new, num_encoding = s._schedule_encoder_inputs(req, 0, 30, 0)
    assert req.num_computed_tokens == 0 and s.encoder_cache.has("old") and s.encoder_cache.evictions == 0
    assert s.encoder_cache.req_to_hashes == {}
    # Keeping "old" would leave no room for "new": the window stops before "old", which is evicted on commit.
    assert (plan.to_encode, plan.reuse, num_new, num_encoding) == ([0], [], 16, 10)
    plan, num_new, _ = s._schedule_encoder_inputs(req, 14, 10, 0)  # a later window reuses it
    assert (plan.to_encode, plan.reuse, num_new) == ([], ["old"], 10)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"b": 16} and so.scheduled_encoder_inputs == {"b": [0]}
    assert so.free_encoder_mm_hashes == ["old"]
    s.update_from_output(so, fake_run(s, so))
    run_to_end(s)
