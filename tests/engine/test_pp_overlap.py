"""The pipeline-parallel batch queue (vlserve/engine/batch_queue.py): up to pipeline_parallel_size batches in flight
with disjoint requests. The scheduler skips requests in flight and caps a batch at its share; PP=2 with overlap is
greedy token for token with PP=1 under many concurrent requests, chunked prefill, preemption and prefix hits, with
two batches really in flight (the engine's vlserve:max_batches_in_flight), and with JSON-constrained requests; one
request alone runs one batch at a time; aborting requests whose batch is in flight (and re-using an aborted id
meanwhile) leaks no KV block and corrupts no output; a stage killed with batches in flight fails the engine naming
it. The queue's own logic (balanced, disjoint batches under max_num_seqs) is also checked without processes."""

from __future__ import annotations

import os
import signal

import pytest

from tests.core.test_scheduler import add, fake_run, make_sched
from tests.engine.conftest import varied_prompts
from vlserve import LLM, SamplingParams
from vlserve.core.request import EngineCoreRequest
from vlserve.executor import WorkerDied

MAX_NEW = 10
IN_FLIGHT = "vlserve:max_batches_in_flight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("qwen2_4l_overlap")), arch="qwen2", num_layers=4)


def _vocab(model_dir: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).vocab_size


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tokens(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]


def _reference(model_dir, prompts) -> list[list[int]]:
    one = LLM(model_dir, dtype="float32", num_kv_blocks=256)
    try:
        return _tokens(one, prompts)
    finally:
        one.shutdown()


def _core_req(rid: str, prompt: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(prompt), _greedy(), 0.0)


def _collect(outputs, into: dict[str, list[int]]) -> None:
    for o in outputs:
        into.setdefault(o.request_id, []).extend(o.new_token_ids)


def test_scheduler_skips_requests_in_flight_caps_the_batch_and_sends_tokens():
    s = make_sched()
    for rid in "abc":
        add(s, rid, 5)
    first = s.schedule(max_num_reqs=2)
    assert list(first.num_scheduled_tokens) == ["a", "b"]  # c waits for the next batch
    s.in_flight_req_ids.update(first.num_scheduled_tokens)
    second = s.schedule(max_num_reqs=2)
    assert list(second.num_scheduled_tokens) == ["c"]
    s.in_flight_req_ids.update(second.num_scheduled_tokens)
    assert s.schedule().is_empty  # every request is in flight
    s.update_from_output(first, fake_run(s, first))
    s.in_flight_req_ids.difference_update(first.num_scheduled_tokens)
    s.send_token_ids = True  # pipeline parallel: the stages that do not sample get the window's known tokens
    third = s.schedule()
    cached = third.scheduled_cached_reqs
    assert list(zip(cached.req_ids, cached.token_starts, cached.new_token_ids)) == [
        ("a", 5, [7]),
        ("b", 5, [7]),
    ]
    s.update_from_output(second, fake_run(s, second))
    s.in_flight_req_ids.clear()
    s.abort_requests(["a", "b", "c"])
    s.check_integrity()


class _FakeCore:
    """What BatchQueue uses of EngineCore, over a real scheduler and an executor that answers in order."""

    def __init__(self, sched):
        self.scheduler, self.num_steps, self.submitted = sched, 0, []
        self.executor = self
        self._observe_timings = lambda so, out: None

    def _schedule(self, max_num_reqs=None):
        return self.scheduler.schedule(max_num_reqs)

    def submit_execute(self, so):
        self.submitted.append(set(so.num_scheduled_tokens))
        return so

    def collect_execute(self, so):
        return fake_run(self.scheduler, so)


def test_batch_queue_keeps_two_balanced_disjoint_batches_in_flight():
    from vlserve.engine.batch_queue import BatchQueue

    s = make_sched(max_num_seqs=4)
    for i in range(6):  # more than max_num_seqs: a batch takes half of the 4 that can run, not of all 6
        add(s, f"q{i}", 5, max_tokens=3)
    core = _FakeCore(s)
    queue = BatchQueue(core, 2)
    tokens: dict[str, list[int]] = {}
    assert queue.step() == [] and len(queue) == 1  # submitted, room for one more: no wait
    for _ in range(50):
        if not s.has_unfinished_requests():
            break
        _collect(queue.step(), tokens)
        in_flight = [b.requests.keys() for b in queue.batches]
        assert sum(map(len, in_flight)) == len(set().union(*in_flight))  # disjoint
        assert s.in_flight_req_ids == set().union(*in_flight)
    queue.drain()
    assert tokens == {f"q{i}": [7, 7, 7] for i in range(6)}
    assert core.submitted[:2] == [{"q0", "q1"}, {"q2", "q3"}] and queue.max_in_flight == 2
    assert all(len(b) <= 2 for b in core.submitted)
    s.check_integrity()


@pytest.mark.slow  # two stage processes
def test_pp2_overlap_matches_pp1_with_chunks_preemption_and_prefix_hits(model_dir):
    vocab = _vocab(model_dir)
    prompts = varied_prompts(vocab, lengths=(1, 3, 17, 40, 95, 160, 7, 25, 60, 12, 33, 80), seed=5)
    base = varied_prompts(vocab, lengths=(70,), seed=3)[0]
    shared = [base + tail for tail in varied_prompts(vocab, lengths=(5, 9, 2), seed=4)]
    want = _reference(model_dir, prompts + shared)
    # 24 blocks of 16 slots for 12 requests that need ~800 at once: preemption; 64 tokens a step: chunked prefill
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=24, max_num_batched_tokens=64, pipeline_parallel_size=2)
    try:
        assert llm.engine.batch_queue.max_batches == 2  # on by default under PP
        got = _tokens(llm, prompts)
        for i, (g, e) in enumerate(zip(got, want)):
            assert g == e, f"prompt {i} (len {len(prompts[i])}) diverged with two batches in flight: {g} vs {e}"
        m = llm.get_metrics()
        assert m[IN_FLIGHT] == 2  # the stages really held two batches at once
        assert m["vlserve:num_preemptions_total"] > 0
        assert m["vlserve:generation_tokens_total"] == MAX_NEW * len(prompts)
        llm.check_integrity()
        assert _tokens(llm, shared[:1]) == want[len(prompts) :][:1]
        assert _tokens(llm, shared[1:]) == want[len(prompts) + 1 :]
        assert llm.get_metrics()["vlserve:prefix_cache_hits_total"] >= 64  # 4 full blocks of the shared prefix
        llm.check_integrity()
        assert not llm.engine.scheduler.in_flight_req_ids and not len(llm.engine.batch_queue)
        # each stage timed its steps (the bubble the benchmark reports): both ran every step, some time blocked
        # handing the stream over, and an idle fraction between 0 and 1
        timings = llm.engine.executor.collective_rpc("stage_timing", True)
        assert len(timings) == 2 and timings[0]["steps"] == timings[1]["steps"] > 0
        for t in timings:
            assert 0 < t["wait_s"] < t["busy_s"] <= t["span_s"] and 0 <= t["idle_fraction"] < 1, t
        assert llm.engine.executor.collective_rpc("stage_timing")[0]["steps"] == 0  # reset
    finally:
        llm.shutdown()


def test_stage_timing_idle_fraction():
    from vlserve.worker.pp_stage import StageTiming

    t = StageTiming()
    assert t.idle_fraction == 0.0 and t.span_s == 0.0
    t.steps, t.busy_s, t.wait_s, t.first_start, t.last_end = 2, 3.0, 1.0, 10.0, 14.0
    # 3 s in steps, 1 of them blocked on the hand-over: 2 s of work in a 4 s span
    assert t.span_s == 4.0 and t.idle_fraction == 0.5
    assert t.summary() == {"steps": 2, "span_s": 4.0, "busy_s": 3.0, "wait_s": 1.0, "idle_fraction": 0.5}


@pytest.mark.slow  # two stage processes
def test_pp2_one_request_then_aborts_while_in_flight(model_dir):
    vocab = _vocab(model_dir)
    prompts = varied_prompts(vocab, lengths=(20, 21, 22, 23, 24, 11), seed=7)
    want = _reference(model_dir, prompts)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, pipeline_parallel_size=2)
    core = llm.engine
    try:
        assert _tokens(llm, prompts[:1]) == want[:1]
        assert core.get_metrics()[IN_FLIGHT] == 1  # one request: one batch at a time, as without the queue
        llm.check_integrity()

        got: dict[str, list[int]] = {}
        for i in range(4):
            core.add_request(_core_req(f"r{i}", prompts[i]))
        _collect(core.step(), got)  # batch A = r0, r1 (each batch takes half of the requests)
        _collect(core.step(), got)  # batch B = r2, r3; A folded back, then A' = r0, r1 submitted
        flight = [set(b.sched_out.num_scheduled_tokens) for b in core.batch_queue.batches]
        assert flight == [{"r2", "r3"}, {"r0", "r1"}], flight
        core.abort_requests(["r2", "r0"])  # one in each batch in flight: freed now, their tokens dropped at fold
        core.add_request(_core_req("r2", prompts[4]))  # the aborted id again, while its old batch is in flight
        seen_before = {rid: list(t) for rid, t in got.items()}
        while core.has_unfinished_requests():
            _collect(core.step(), got)
        assert got["r1"] == want[1] and got["r3"] == want[3]
        assert got["r2"] == want[4]  # the new r2 got none of the old one's tokens
        assert got.get("r0", []) == seen_before.get("r0", [])  # nothing after its abort
        llm.check_integrity()  # no KV block or encoder entry leaked; the stages dropped every request

        core.add_request(_core_req("lone", prompts[5]))
        core.step()  # submitted, in flight
        assert len(core.batch_queue) == 1
        core.abort_requests(["lone"])  # nothing left to run: the batch is drained and the runner told at once
        assert not len(core.batch_queue) and not core.scheduler.in_flight_req_ids
        llm.check_integrity()
        assert _tokens(llm, prompts[5:]) == want[5:]
    finally:
        llm.shutdown()


@pytest.mark.slow  # two stage processes
def test_stage_killed_with_batches_in_flight_fails_naming_it(model_dir):
    prompts = varied_prompts(_vocab(model_dir), lengths=(30, 31, 32, 33), seed=8)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, pipeline_parallel_size=2)
    core = llm.engine
    try:
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"k{i}", p, _greedy(200), 0.0))
        core.step()
        core.step()
        assert len(core.batch_queue) == 2
        os.kill(llm.engine.executor.procs[1].pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match=r"rank 1 \(pipeline stage 1\) \(pid \d+\) was killed by signal 9"):
            for _ in range(100):
                core.step()
    finally:
        llm.shutdown()


@pytest.mark.slow  # two stage processes
def test_pp2_overlap_structured_outputs_match_pp1():
    # a batch's grammar bitmask is built from its requests' matchers, which are up to date: requests in flight are
    # not scheduled again until their tokens are folded back
    from tests.engine.test_structured_engine import PROMPTS, _check_json, _json
    from vlserve.demo import default_model_path

    kw = dict(dtype="float32", num_kv_blocks=256, max_model_len=1024, seed=0)
    params = _json(temperature=0.0)
    one = LLM(default_model_path(), **kw)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(PROMPTS * 2, params, use_tqdm=False)]
    finally:
        one.shutdown()
    llm = LLM(default_model_path(), pipeline_parallel_size=2, **kw)
    try:
        outs = llm.generate(PROMPTS * 2, params, use_tqdm=False)
        for o in outs:
            _check_json(o)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.get_metrics()[IN_FLIGHT] == 2
        llm.check_integrity()
    finally:
        llm.shutdown()
