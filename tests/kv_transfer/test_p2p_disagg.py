"""Disaggregated prefill / decode with the P2PConnector (two engines in this process, Mooncake over TCP): prefill
on A (max_tokens=1, producer) then decode on B (consumer, reading A's blocks) gives the tokens one engine gives,
token for token; A frees its kept blocks on B's confirmation (or a timeout), B's other requests keep stepping while
a read runs, and nothing leaks on either side."""

from __future__ import annotations

import time

import pytest

from vlserve import LLM, SamplingParams
from vlserve.config import KVTransferConfig

BLOCK = 4
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _llm(model_dir, role=None, **extra):
    cfg = None if role is None else KVTransferConfig("P2PConnector", role, extra)
    return LLM(
        model_dir, dtype="float32", num_kv_blocks=32, max_model_len=96, block_size=BLOCK, seed=0, kv_transfer_config=cfg
    )


def _prompts(seed=0, lengths=(13, 16, 30)):
    """Fresh prompts per test (no prefix hit on either engine from an earlier test)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]


def _gen(llm, prompt, max_tokens, params=None):
    sp = SamplingParams(max_tokens=max_tokens, kv_transfer_params=params, **GREEDY)
    return llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]


def _wait_freed(llm, limit_s=10.0):
    """Wait (without stepping the engine here) until the idle LLM's own poller has freed its kept blocks."""
    t0 = time.monotonic()
    while _sched(llm).kv_transfer.kept_blocks:
        assert time.monotonic() - t0 < limit_s, "kept blocks not freed by the idle engine"
        time.sleep(0.01)


def _sched(llm):
    return llm.engine.scheduler


@pytest.fixture(scope="module")
def engines(qwen2_dir, mooncake):
    ref = _llm(qwen2_dir)
    outs = [list(_gen(ref, p, 8).outputs[0].token_ids) for p in _prompts() + _prompts(1, (30,)) + _prompts(2, (30,))]
    del ref
    return _llm(qwen2_dir, "kv_producer"), _llm(qwen2_dir, "kv_consumer"), outs


def test_prefill_on_a_decode_on_b_same_tokens(engines):
    a, b, ref = engines
    for prompt, want in zip(_prompts(), ref[:3]):
        pre = _gen(a, prompt, 1, {"do_remote_decode": True})
        params = pre.kv_transfer_params
        assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt)
        assert len(params["remote_block_ids"]) == -(-len(prompt) // BLOCK)
        assert list(pre.outputs[0].token_ids) == want[:1]
        assert _sched(a).kv_transfer.kept_blocks  # A keeps the blocks for B
        kept = a.get_metrics()
        assert kept["vlserve:kv_kept_requests"] == 1 and kept["vlserve:kv_kept_blocks"] == -(-len(prompt) // BLOCK)
        out = _gen(b, prompt, 8, params)
        assert list(out.outputs[0].token_ids) == want
        _wait_freed(a)  # B's confirmation frees them, A idle (its poller steps it)
        a.check_integrity()
        b.check_integrity()
    m = b.get_metrics()  # every prompt token but the last read from A: 12, 15, 29 tokens = 3 + 4 + 8 blocks
    assert m["vlserve:kv_p2p_loaded_blocks_total"] == 15 and m["vlserve:kv_p2p_failed_loads_total"] == 0
    assert m["vlserve:kv_p2p_loads_done_total"] == 3 and m["vlserve:num_requests_waiting_for_kv"] == 0
    assert m["vlserve:kv_free_blocks"] == 32 and m["vlserve:kv_used_blocks"] == 0
    ma = a.get_metrics()
    assert ma["vlserve:kv_p2p_kept_requests_total"] == 3 and ma["vlserve:kv_p2p_sends_confirmed_total"] == 3
    assert ma["vlserve:kv_kept_blocks"] == 0 and ma["vlserve:kv_free_blocks"] == 32
    assert ma["vlserve:kv_p2p_send_timeouts_total"] == 0


def test_unreachable_producer_recomputes(engines):
    a, b, ref = engines
    prompt = _prompts(1, (30,))[0]
    bogus = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_request_id": "x",
        "remote_engine_id": "?",
        "remote_block_ids": list(range(8)),
        "remote_num_tokens": len(prompt),
    }
    before = b.get_metrics()["vlserve:kv_p2p_failed_loads_total"]
    out = _gen(b, prompt, 8, bogus)
    assert list(out.outputs[0].token_ids) == ref[3]
    m = b.get_metrics()
    assert m["vlserve:kv_p2p_failed_loads_total"] == before + 1
    assert m["vlserve:num_requests_waiting_for_kv"] == 0 and m["vlserve:kv_used_blocks"] == 0
    b.check_integrity()


def test_producer_frees_on_timeout(qwen2_dir, mooncake):
    """No consumer ever reads: the idle producer frees its kept blocks after send_timeout_s on its own."""
    a = _llm(qwen2_dir, "kv_producer", send_timeout_s=0.5)
    _gen(a, _prompts()[0], 1, {"do_remote_decode": True})
    assert _sched(a).kv_transfer.kept_blocks
    steps = a.engine.num_steps
    _wait_freed(a)
    assert a.engine.num_steps > steps  # the poller stepped it
    m = a.get_metrics()
    assert m["vlserve:kv_p2p_send_timeouts_total"] == 1 and m["vlserve:kv_p2p_sends_confirmed_total"] == 0
    assert m["vlserve:kv_kept_blocks"] == 0 and m["vlserve:kv_free_blocks"] == 32
    a.check_integrity()
    a.shutdown()


def test_idle_producer_frees_on_confirmation_without_steps(engines):
    """A finishes its prefill and nothing else runs on A; B reads and confirms; A's kept blocks are freed by A's own
    idle poller (this test never steps A)."""
    a, b, ref = engines
    prompt = _prompts(3, (21,))[0]
    params = _gen(a, prompt, 1, {"do_remote_decode": True}).kv_transfer_params
    assert _sched(a).kv_transfer.kept_blocks and a._kv_poller is not None
    time.sleep(0.1)
    assert _sched(a).kv_transfer.kept_blocks  # nobody confirmed yet: still kept (send_timeout_s is 120 s)
    _gen(b, prompt, 4, params)
    _wait_freed(a)
    t0 = time.monotonic()
    while a._kv_poller is not None:  # the poller ends once nothing is kept
        assert time.monotonic() - t0 < 5
        time.sleep(0.01)
    a.check_integrity()
    b.check_integrity()


def test_decode_reads_the_producers_blocks(engines):
    """The consumer's tokens come from A's KV: scrambling A's kept blocks before B reads them changes B's output
    (and its first token still comes from B's own forward over the last prompt token)."""
    import torch

    a, b, ref = engines
    prompt = _prompts(2, (30,))[0]
    params = _gen(a, prompt, 1, {"do_remote_decode": True}).kv_transfer_params
    with torch.no_grad():
        for pair in a.engine.executor.worker.runner.kv_caches:
            for t in pair:
                t[params["remote_block_ids"]] = torch.randn_like(t[params["remote_block_ids"]]) * 10
    out = _gen(b, prompt, 8, params)
    assert list(out.outputs[0].token_ids) != ref[4]
    _wait_freed(a)
    a.check_integrity()
    b.check_integrity()
