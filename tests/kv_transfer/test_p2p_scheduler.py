"""The P2P connector's scheduler side with a fake worker (pure Python, no Mooncake): the producer keeps a finished
request's blocks until a worker reports the send (confirmation or timeout), the consumer parks a request while its
read runs (others keep decoding) and resumes from the loaded tokens, aborts while reading keep the blocks until the
read ends, and nothing leaks (check_integrity after every step)."""

from __future__ import annotations

from vlserve.config import KVTransferConfig, SchedulerConfig
from vlserve.core.request import EngineCoreRequest
from vlserve.core.sched_output import ModelRunnerOutput
from vlserve.core.scheduler import Scheduler
from vlserve.distributed.kv_transfer.base import KVConnectorOutput
from vlserve.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(100, 114))  # 14 tokens: 4 blocks


def make(role, num_blocks=16):
    cfg = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=BS,
        kv_transfer_config=KVTransferConfig("P2PConnector", role, {"_side_channel_port": 5555}),
    )
    return Scheduler(cfg, num_blocks)


def add(s, rid, tokens, max_tokens, params=None):
    s.add_request(
        EngineCoreRequest(
            rid,
            list(tokens),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, kv_transfer_params=params),
            0.0,
            [],
        )
    )


def step(s, kv_out=None):
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    toks = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
    out = ModelRunnerOutput(ids, toks)
    out.kv_connector_output = kv_out or KVConnectorOutput()
    outs = s.update_from_output(so, out)
    s.check_integrity()
    return so, outs


def test_producer_keeps_blocks_until_sent():
    s = make("kv_producer")
    add(s, "p", PROMPT, 1, {"do_remote_decode": True})
    add(s, "plain", PROMPT[:5], 1)
    _, outs = step(s)
    params = {o.request_id: o.kv_transfer_params for o in outs}
    assert params["plain"] is None
    p = params["p"]
    assert p["do_remote_prefill"] and p["remote_port"] == 5555 and p["remote_num_tokens"] == 14
    assert len(p["remote_block_ids"]) == 4 and not s.has_unfinished_requests()
    assert set(s.kv_transfer.kept_blocks) == {"p"} and s.kv.get_block_ids("p")[0][:4] == p["remote_block_ids"]
    so, _ = step(s)  # an idle step still asks the worker (metadata) and lists the new send
    assert so.kv_connector_metadata.new_sends == ["p"]
    step(s, KVConnectorOutput(finished_sending={"p"}))
    assert not s.kv_transfer.kept_blocks and s.kv.pool.num_free_blocks == s.kv.pool.num_usable_blocks
    assert s.schedule().kv_connector_metadata is None


def test_consumer_parks_while_reading_and_resumes():
    s = make("kv_consumer")
    add(s, "other", list(range(50, 58)), 6)
    step(s)
    remote = {
        "do_remote_prefill": True,
        "remote_host": "h",
        "remote_port": 1,
        "remote_request_id": "p",
        "remote_block_ids": [9, 8, 7, 6],
        "remote_num_tokens": 14,
    }
    add(s, "d", PROMPT, 3, remote)
    so, _ = step(s)
    load = so.kv_connector_metadata.loads["d"]
    assert load.remote_block_ids == [9, 8, 7, 6] and load.local_block_ids == s.kv.get_block_ids("d")[0]
    assert "d" in s.kv_transfer.waiting_for_kv and "d" not in so.num_scheduled_tokens
    for _ in range(2):  # the read runs: "other" keeps decoding, "d" waits
        so, _ = step(s)
        assert so.num_scheduled_tokens == {"other": 1} and so.kv_connector_metadata is not None
    step(s, KVConnectorOutput(finished_recving={"d"}))
    so, _ = step(s)
    assert so.num_scheduled_tokens["d"] == 1  # only the last prompt token is computed here
    while s.has_unfinished_requests():
        step(s)
    assert s.get_num_unfinished_requests() == 0


def test_consumer_failed_read_recomputes_and_abort_while_reading():
    s = make("kv_consumer")
    remote = {
        "do_remote_prefill": True,
        "remote_host": "h",
        "remote_port": 1,
        "remote_request_id": "p",
        "remote_block_ids": [1, 2, 3, 4],
        "remote_num_tokens": 14,
    }
    add(s, "f", PROMPT, 2, remote)
    step(s)
    step(s, KVConnectorOutput(finished_recving={"f"}, failed_recving={"f"}))
    so, _ = step(s)
    assert so.num_scheduled_tokens["f"] == 14  # recomputed
    while s.has_unfinished_requests():
        step(s)
    add(s, "x", PROMPT[::-1], 2, dict(remote, remote_request_id="q"))
    step(s)
    assert s.abort_requests(["x"]) == ["x"]
    assert "x" in s.kv_transfer.kept_blocks  # its read may still write into them
    step(s, KVConnectorOutput(finished_recving={"x"}))
    assert not s.kv_transfer.kept_blocks
    step(s)
    s.check_integrity()


def test_mismatched_params_recompute_and_release():
    s = make("kv_consumer")
    add(
        s,
        "m",
        PROMPT,
        2,
        {
            "do_remote_prefill": True,
            "remote_host": "h",
            "remote_port": 1,
            "remote_request_id": "p",
            "remote_block_ids": [1],
            "remote_num_tokens": 99,
        },
    )
    so, _ = step(s)
    assert so.num_scheduled_tokens["m"] == 14
    assert so.kv_connector_metadata.loads["m"].remote_block_ids == []  # only tells the producer to free
