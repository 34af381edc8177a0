"""The scheduler with LoRA requests (no model, no torch): at most max_loras distinct adapters per step (waiting and
running requests alike wait for room, in order), block hashes carry the adapter id (base hashes unchanged), and a
LoRA request on an engine without LoRA is refused."""

from dataclasses import dataclass

import pytest
from test_scheduler import fake_run, make_sched

from vlserve.core.kv_cache_manager import hash_block
from vlserve.core.request import EngineCoreRequest


@dataclass(frozen=True)
class Lora:  # what the core reads of a vlserve.lora.LoRARequest
    lora_name: str
    lora_int_id: int
    lora_path: str = "/nowhere"


def add(s, rid, lora, n_prompt=6, max_tokens=3, prompt=None):
    from vlserve.sampling_params import SamplingParams

    s.add_request(
        EngineCoreRequest(
            rid, prompt or list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), 0.0, [], lora
        )
    )


def adapters_of(s, so):
    return {s.requests[r].lora_int_id for r in so.num_scheduled_tokens if r in s.requests} - {0}


def test_at_most_max_loras_adapters_per_step():
    s = make_sched(max_loras=2)
    for i, lid in enumerate([1, 2, 3, 0, 1, 3, 0, 2]):
        add(s, f"r{i}", Lora(f"l{lid}", lid) if lid else None)
    seen, done = set(), set()
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        ids = {s.requests[r].lora_int_id for r in so.num_scheduled_tokens}
        assert len(ids - {0}) <= 2
        seen |= ids
        for new in so.scheduled_new_reqs:  # the runner learns each request's adapter
            assert (new.lora_request.lora_int_id if new.lora_request else 0) == s.requests[new.req_id].lora_int_id
        for o in s.update_from_output(so, fake_run(s, so)):
            if o.finished:
                done.add(o.request_id)
    assert done == {f"r{i}" for i in range(8)} and seen == {0, 1, 2, 3}
    s.check_integrity()


def test_lora_blocked_waiting_requests_keep_their_order():
    s = make_sched(max_loras=1)
    add(s, "a1", Lora("a", 1))
    add(s, "b1", Lora("b", 2))
    add(s, "base", None)
    add(s, "a2", Lora("a", 1))
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"a1", "base", "a2"}  # b waits for a step without adapter a
    assert [r.request_id for r in s.waiting] == ["b1"]


def test_block_hashes_carry_the_adapter():
    s = make_sched(max_loras=2)
    prompt = list(range(1, 10))
    add(s, "base", None, prompt=prompt)
    add(s, "a", Lora("a", 1), prompt=prompt)
    add(s, "b", Lora("b", 2), prompt=prompt)
    s.schedule()
    h = {r: s.requests[r].block_hashes for r in ("base", "a", "b")}
    assert h["base"][0] == hash_block(None, (1, 2, 3, 4), ())  # base requests keep today's hashes
    assert h["a"][0] == hash_block(None, (1, 2, 3, 4), ("lora:1",))
    assert not set(h["base"]) & set(h["a"]) and not set(h["a"]) & set(h["b"])


def test_prefix_hits_stay_within_an_adapter():
    s = make_sched(max_loras=2)
    prompt = list(range(1, 14))
    add(s, "a1", Lora("a", 1), prompt=prompt, max_tokens=1)
    so = s.schedule()
    s.update_from_output(so, fake_run(s, so))
    add(s, "b1", Lora("b", 2), prompt=prompt, max_tokens=1)
    add(s, "a2", Lora("a", 1), prompt=prompt, max_tokens=1)
    so = s.schedule()
    new = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    assert new == {"b1": 0, "a2": 12}


def test_lora_request_without_lora_is_refused():
    s = make_sched()
    with pytest.raises(ValueError, match="enable_lora"):
        add(s, "x", Lora("a", 1))


def test_requests_wait_while_their_adapter_loads_and_fail_with_its_error():
    s = make_sched(max_loras=2)
    s.loras_loading.update({1, 2})
    add(s, "a", Lora("a", 1))
    add(s, "base", None)
    add(s, "b", Lora("b", 2))
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"base"}  # the others keep their place in the queue
    assert [r.request_id for r in s.waiting] == ["a", "b"]
    s.loras_loading.discard(1)
    s.fail_lora(2, "missing adapter_model.safetensors")
    assert [(o.request_id, o.finish_reason, o.extra["error"]) for o in s.failed] == [
        ("b", "abort", "missing adapter_model.safetensors")
    ]
    assert "b" not in s.requests and not s.loras_loading
    fake_run(s, so)
    so = s.schedule()
    assert "a" in so.num_scheduled_tokens
    s.check_integrity()
