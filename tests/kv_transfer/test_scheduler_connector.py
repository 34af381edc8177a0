"""The scheduler side of the KV-connector seam with the offloading connector and a fake worker (pure Python):
stores after the step that fills a block, loads past the device hit with the request parked until reported,
failed loads recompute, aborts while loading, roles."""

from __future__ import annotations

from vlserve.config import KVTransferConfig, SchedulerConfig
from vlserve.core.request import EngineCoreRequest
from vlserve.core.sched_output import ModelRunnerOutput
from vlserve.core.scheduler import Scheduler
from vlserve.distributed.kv_transfer.base import KVConnectorOutput
from vlserve.sampling_params import SamplingParams

BS = 4


def make(role="kv_both", num_blocks=16, cpu_blocks=64):
    cfg = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=128,
        block_size=BS,
        kv_transfer_config=KVTransferConfig("OffloadingConnector", role, {"_num_cpu_blocks": cpu_blocks}),
    )
    return Scheduler(cfg, num_blocks)


def add(s, rid, tokens, max_tokens=2):
    s.add_request(EngineCoreRequest(rid, list(tokens), SamplingParams(max_tokens=max_tokens), 0.0, []))


def step(s, fail=(), report=True):
    """Schedule and fold back a fake runner's output: 7 for each request at its last token; every planned load
    reported done (those in `fail` failed)."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    toks = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
    out = ModelRunnerOutput(ids, toks)
    meta = so.kv_connector_metadata
    if report and meta is not None and meta.loads:
        out.kv_connector_output = KVConnectorOutput(
            finished_recving=set(meta.loads), failed_recving=set(meta.loads) & set(fail)
        )
    s.update_from_output(so, out)
    s.check_integrity()
    return so


def run(s):
    steps = []
    while s.has_unfinished_requests():
        steps.append(step(s))
        assert len(steps) < 100
    return steps


PROMPT = list(range(100, 130))  # 30 tokens: 7 full blocks


def test_store_then_load_past_the_device_hit():
    s = make()
    add(s, "a", PROMPT)
    first = step(s)
    stores = first.kv_connector_metadata.stores
    assert len(stores) == 7 and all(slot >= 0 for _, slot, _, _ in stores)  # the prefill's full blocks
    run(s)
    assert s.kv.reset_prefix_cache()  # the device forgets; the host tier remembers
    add(s, "b", PROMPT + [1, 2])
    so = step(s)
    assert so.num_scheduled_tokens == {}  # b waits for its load
    assert [len(v) for v in so.kv_connector_metadata.loads.values()] == [7]
    so = step(s)  # the load was reported: b runs from token 28
    assert so.num_scheduled_tokens == {"b": 4} and so.scheduled_new_reqs[0].num_computed_tokens == 28
    run(s)
    assert s.kv_transfer.connector.stats()["kv_offload_hit_tokens_total"] == 28


def test_failed_load_recomputes_from_the_device_hit():
    s = make()
    add(s, "a", PROMPT)
    run(s)
    s.kv.reset_prefix_cache()
    add(s, "b", PROMPT)
    step(s, fail={"b"})
    so = step(s)
    assert so.num_scheduled_tokens == {"b": 30} and so.scheduled_new_reqs[0].num_computed_tokens == 0
    run(s)
    assert s.kv_transfer.connector.stats()["kv_offload_load_failures_total"] == 1
    assert s.kv_transfer.connector.stats()["kv_offload_hit_tokens_total"] == 0


def test_abort_while_loading_frees_the_blocks():
    s = make()
    add(s, "a", PROMPT)
    run(s)
    s.kv.reset_prefix_cache()
    add(s, "b", PROMPT)
    so = step(s, report=False)
    assert "b" in s.kv_transfer.waiting_for_kv and s.kv.req_to_blocks["b"]
    assert s.abort_requests(["b"]) == ["b"]
    assert not s.has_unfinished_requests()
    s.update_from_output(
        so.__class__([], [], {}, 0),
        ModelRunnerOutput([], [], kv_connector_output=KVConnectorOutput(finished_recving={"b"})),
    )  # the late report is ignored
    s.check_integrity()


def test_roles():
    producer, consumer = make("kv_producer"), make("kv_consumer")
    for s in (producer, consumer):
        add(s, "a", PROMPT)
        run(s)
        s.kv.reset_prefix_cache()
    assert producer.kv_transfer.connector.stats()["kv_offload_stores_total"] == 7
    assert consumer.kv_transfer.connector.stats()["kv_offload_stores_total"] == 0
    add(producer, "b", PROMPT)
    assert producer.schedule().num_scheduled_tokens == {"b": 30}  # a producer never loads


def test_host_lru_evicts_oldest():
    s = make(cpu_blocks=4)
    add(s, "a", PROMPT)
    run(s)
    st = s.kv_transfer.connector.stats()
    assert st["kv_offload_host_blocks"] == 4 and st["kv_offload_evictions_total"] == 3
    s.kv.reset_prefix_cache()
    add(s, "b", PROMPT)
    so = step(s)
    assert so.num_scheduled_tokens == {"b": 30}  # block 0 was evicted: no prefix in the tier
