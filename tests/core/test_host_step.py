"""The lean host step's shortcuts give what the plain per-token / full paths give (no model, no torch)."""

import random

from vlserve.config import SchedulerConfig
from vlserve.core.kv_cache_manager import KVCacheManager
from vlserve.core.request import EngineCoreRequest, Request, RequestStatus
from vlserve.core.sched_output import ModelRunnerOutput
from vlserve.core.scheduler import Scheduler
from vlserve.sampling_params import SamplingParams


def _reference_accept(req: Request, sampled: list[int], max_model_len: int) -> list[int]:
    """The per-token rule: append, then stop on a stop token (min_tokens out), max_tokens or max_model_len."""
    kept = []
    for tok in sampled:
        kept.append(tok)
        req.append_output_token_ids([tok])
        n_out = req.num_output_tokens
        if n_out >= req.sampling_params.min_tokens and tok in req.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = None if tok in req.sampling_params._eos_token_ids else tok
            break
        if n_out >= req.max_tokens or req.num_tokens >= max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            break
    return kept


def _request(rng: random.Random, n_prompt: int) -> Request:
    max_tokens = rng.randint(1, 6)
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=rng.randint(0, min(2, max_tokens)),
        stop_token_ids=rng.choice([[], [3], [3, 5]]),
        ignore_eos=rng.random() < 0.5,
        _eos_token_ids=(5,),
    )
    req = Request(EngineCoreRequest("r", list(range(10, 10 + n_prompt)), params, 0.0), max_tokens)
    req.append_output_token_ids([9] * rng.randint(0, params.max_tokens - 1))
    return req


def test_accept_tokens_matches_the_per_token_rule():
    rng = random.Random(0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=12, block_size=4), 8)
    seen = set()
    for _ in range(3000):
        n_prompt = rng.randint(1, 9)
        sampled = [rng.choice([3, 4, 5, 6]) for _ in range(rng.randint(1, 4))]
        state = rng.getstate()
        fast, ref = _request(rng, n_prompt), None
        rng.setstate(state)
        ref = _request(rng, n_prompt)
        kept = fast.accept_sampled(sampled, sched.config.max_model_len)
        assert kept == _reference_accept(ref, sampled, 12)
        assert (fast.status, fast.stop_reason, fast.all_token_ids) == (ref.status, ref.stop_reason, ref.all_token_ids)
        seen.add((fast.status, len(kept) < len(sampled)))
    # every outcome was exercised: running, stopped and length-capped, with and without dropped tokens
    assert {RequestStatus.WAITING, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH} <= {
        s for s, _ in seen
    }
    assert (RequestStatus.FINISHED_STOPPED, True) in seen and (RequestStatus.FINISHED_LENGTH, True) in seen


def test_decode_fast_path_still_registers_a_block_filled_without_a_new_one():
    """With lookahead the last block is allocated early; it must be registered for reuse the step it fills."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = Request(EngineCoreRequest("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8), 0.0), 8)
    assert len(kv.allocate_slots(req, 5, num_lookahead_tokens=3)[0]) == 2  # 8 slots: 2 blocks
    req.num_computed_tokens = 5
    for tok in (6, 7, 8):  # decode steps: each fits in the 2 blocks
        req.append_output_token_ids([tok])
        assert kv.allocate_slots(req, 1) == ()
        req.num_computed_tokens += 1
    assert len(kv.get_block_ids("a")[0]) == 2
    # tokens 1..8 are written: both blocks are registered, so a request continuing them hits all 8 tokens
    twin = Request(EngineCoreRequest("b", [1, 2, 3, 4, 5, 6, 7, 8, 99], SamplingParams(max_tokens=8), 0.0), 8)
    hits, n = kv.get_computed_blocks(twin)
    assert n == 8 and [b.block_id for b in hits[0]] == kv.get_block_ids("a")[0]
    kv.check_integrity()


def test_kv_room_kept_on_the_request_matches_the_block_tables():
    """The decode fast path reads the room a request's blocks leave from the request; over random runs (prefix
    caching on and off, lookahead, preemption in a small pool) it always equals what the block tables hold."""
    rng = random.Random(1)
    for caching in (True, False):
        for num_spec in (0, 2):
            cfg = SchedulerConfig(
                max_num_seqs=6,
                max_num_batched_tokens=32,
                max_model_len=40,
                block_size=4,
                enable_prefix_caching=caching,
                num_spec_tokens=num_spec,
            )
            sched = Scheduler(cfg, 14)
            for i in range(10):
                prompt = [rng.randint(1, 3) for _ in range(rng.randint(2, 12))]
                params = SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True)
                sched.add_request(EngineCoreRequest(f"r{i}", prompt, params, float(i)))
            preempted = 0
            while sched.has_unfinished_requests():
                out = sched.schedule()
                preempted += sum(rid in sched.requests for rid in out.finished_req_ids)
                for req in sched.requests.values():
                    blocks = sched.kv.req_to_blocks.get(req.request_id)
                    assert req.kv_token_capacity == (len(blocks[0]) * cfg.block_size if blocks else 0)
                    if blocks is None:
                        assert req.kv_registered_limit == -1
                ids = list(out.num_scheduled_tokens)
                sampled = [[rng.randint(1, 3)] if sched.requests[r].num_output_placeholders else [] for r in ids]
                sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
                sched.check_integrity()
            assert preempted > 0  # the small pool made requests give their blocks back


def _run_to_the_end(plain: bool, seed: int) -> list[list[tuple]]:
    """Each step's EngineCoreOutputs of a random stop-token / length workload in a small pool (preemption), with
    update_from_output's decode fast path on or off."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=24, max_model_len=30, block_size=4)
    sched = Scheduler(cfg, 12)
    for i in range(8):
        params = SamplingParams(
            max_tokens=rng.randint(2, 12), min_tokens=rng.randint(0, 2), stop_token_ids=[3], _eos_token_ids=(5,)
        )
        sched.add_request(EngineCoreRequest(f"r{i}", [rng.randint(1, 9) for _ in range(rng.randint(2, 10))], params, i))
        sched.requests[f"r{i}"].plain_output &= plain
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = [[rng.randint(1, 9)] if sched.requests[r].num_output_placeholders else [] for r in ids]
        results = sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled))
        steps.append(
            [(o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason, o.num_cached_tokens) for o in results]
        )
        sched.check_integrity()
    return steps


def test_update_fast_path_gives_the_general_path_outputs():
    for seed in range(20):
        assert _run_to_the_end(True, seed) == _run_to_the_end(False, seed)
