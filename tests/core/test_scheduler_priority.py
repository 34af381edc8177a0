"""Scheduling policy "priority" (vLLM's): waiting requests run in (priority, arrival) order, lower first, and when KV
blocks run out the lowest-priority, latest-arrived running request is preempted; "fcfs" refuses a priority.
Hand-made runner outputs, no model."""

import itertools

import pytest

from vlserve.config import SchedulerConfig
from vlserve.core.request import EngineCoreRequest
from vlserve.core.request_queue import PriorityQueue
from vlserve.core.sched_output import ModelRunnerOutput
from vlserve.core.scheduler import Scheduler
from vlserve.sampling_params import SamplingParams

_first_tokens = itertools.count(100)  # a distinct first token per request: no prefix sharing


def make_sched(num_blocks=64, policy="priority", **kw):
    cfg = SchedulerConfig(
        **{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256, "block_size": 4, **kw},
        scheduling_policy=policy,
    )
    return Scheduler(cfg, num_blocks)


def add(s, rid, priority, arrival, n_prompt=3, max_tokens=2):
    prompt = [next(_first_tokens)] + list(range(2, n_prompt + 1))
    s.add_request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival, priority=priority))


def fake_run(s, so, token=7):
    """A runner that samples `token` for each request whose window reached its last known token."""
    ids = list(so.num_scheduled_tokens)
    toks = [[token] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
    return ModelRunnerOutput(ids, toks)


def step(s):
    so = s.schedule()
    outs = s.update_from_output(so, fake_run(s, so))
    s.check_integrity()
    return so, outs


def admission_order(s, max_steps=200):
    order = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        so, _ = step(s)
        order += [r.req_id for r in so.scheduled_new_reqs]
    assert not s.has_unfinished_requests()
    return order


def test_waiting_requests_run_by_priority_then_arrival():
    s = make_sched(max_num_seqs=1)
    add(s, "late-low", priority=3, arrival=1.0)
    add(s, "urgent", priority=-1, arrival=4.0)
    add(s, "mid-later", priority=1, arrival=3.0)
    add(s, "mid-earlier", priority=1, arrival=2.0)
    assert admission_order(s) == ["urgent", "mid-earlier", "mid-later", "late-low"]


def test_fcfs_runs_by_arrival_and_refuses_a_priority():
    s = make_sched(max_num_seqs=1, policy="fcfs")
    add(s, "first", priority=0, arrival=5.0)
    add(s, "second", priority=0, arrival=1.0)
    with pytest.raises(ValueError, match="priority scheduling is off"):
        add(s, "bad", priority=2, arrival=0.0)
    assert "bad" not in s.requests and len(s.waiting) == 2
    assert admission_order(s) == ["first", "second"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_sched(policy="lifo")


def run_until_preempted(s, max_steps=50):
    for _ in range(max_steps):
        step(s)
        if s.stats.num_preemptions:
            return [r for r in s.requests.values() if r.num_preemptions]
    raise AssertionError("nothing was preempted")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_out_of_blocks_preempts_the_lowest_priority_running_request(policy):
    # 6 blocks of 4 tokens; two requests of 8-token prompts that grow to 20 tokens each cannot both fit
    s = make_sched(num_blocks=6, policy=policy)
    add(s, "background", priority=5 if policy == "priority" else 0, arrival=0.0, n_prompt=8, max_tokens=12)
    step(s)  # background is admitted first
    add(s, "interactive", priority=0, arrival=1.0, n_prompt=8, max_tokens=12)
    preempted = run_until_preempted(s)
    # fcfs: the latest admitted goes; priority: the lower priority one, though it was admitted first
    assert [r.request_id for r in preempted] == ["interactive" if policy == "fcfs" else "background"]
    victim = preempted[0]
    assert victim in s.waiting and victim.num_computed_tokens == 0
    outs = {}
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        _, got = step(s)
        for o in got:
            outs[o.request_id] = outs.get(o.request_id, 0) + len(o.new_token_ids)
    assert outs["background"] + outs["interactive"] >= 12 and outs[victim.request_id] >= 1
    assert not s.has_unfinished_requests() and s.kv.pool.num_free_blocks == s.kv.pool.num_usable_blocks


def test_running_list_is_kept_in_priority_order():
    s = make_sched()
    add(s, "c", priority=2, arrival=0.0, max_tokens=5)
    step(s)
    add(s, "a", priority=0, arrival=1.0, max_tokens=5)
    add(s, "b", priority=1, arrival=2.0, max_tokens=5)
    add(s, "c2", priority=2, arrival=3.0, max_tokens=5)
    step(s)
    assert [r.request_id for r in s.running] == ["a", "b", "c", "c2"]


def test_priority_queue_puts_requests_back_in_place():
    s = make_sched()
    add(s, "x", priority=1, arrival=0.0)
    add(s, "y", priority=0, arrival=1.0)
    add(s, "z", priority=1, arrival=2.0)
    q = s.waiting
    assert isinstance(q, PriorityQueue) and [r.request_id for r in q] == ["y", "x", "z"]
    head = q.popleft()
    q.extendleft([q.popleft()])  # set aside and put back: its place again
    q.appendleft(head)
    assert [r.request_id for r in q] == ["y", "x", "z"] and q[0] is head and len(q) == 3
    q.remove(head)
    assert [r.request_id for r in q] == ["x", "z"]


def test_requests_whose_kv_load_ended_go_first_in_the_same_fcfs_queue():
    s = make_sched(policy="fcfs")
    add(s, "x", priority=0, arrival=0.0)
    add(s, "y", priority=0, arrival=1.0)
    s.kv_transfer.load_done["y"] = 0
    resumed = s.kv_transfer.resumed_first(s.waiting)
    assert type(resumed) is type(s.waiting) and [r.request_id for r in resumed] == ["y", "x"]
    resumed.add_running([], resumed[0])  # still the policy's queue
