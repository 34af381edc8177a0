"""The offloading connector end to end: greedy tokens with a host / disk KV tier equal those without it, on a
workload whose shared prefixes do not fit a tiny device pool; the disk tier across engines; bad files recompute."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from vlserve import LLM, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _workload(vocab: int = 200, num_prefixes: int = 4, prefix_len: int = 64, seed: int = 0) -> list[list[int]]:
    """Requests over `num_prefixes` shared prefixes of 4 blocks, visited round robin: A1 B1 C1 D1 A2 B2 ..., so a
    pool of ~2 requests' blocks has evicted A's prefix by the time A2 comes."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(3, vocab, (prefix_len,), generator=g).tolist() for _ in range(num_prefixes)]
    out = []
    for round_ in range(3):
        for p in prefixes:
            out.append(p + torch.randint(3, vocab, (5 + round_,), generator=g).tolist())
    return out


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """One request at a time (the device pool is too small to keep an earlier prefix)."""
    outs = []
    for p in prompts:
        outs.append(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        llm.check_integrity()
    return outs


def _llm(model_dir: str, **kw) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=12, max_model_len=160, block_size=BLOCK, seed=0, **kw)


@pytest.fixture(scope="module")
def reference(qwen2_dir):
    llm = _llm(qwen2_dir)
    prompts = _workload()
    out = _run(llm, prompts)
    metrics = llm.get_metrics()
    assert "vlserve:kv_offload_hit_tokens_total" not in metrics
    return prompts, out, metrics["vlserve:prefix_cache_hits_total"]


def test_host_tier_same_tokens_and_hits(qwen2_dir, reference):
    prompts, expected, device_hits_alone = reference
    llm = _llm(qwen2_dir, kv_offloading_size=0.01)
    assert _run(llm, prompts) == expected
    m = llm.get_metrics()
    assert m["vlserve:kv_offload_hit_tokens_total"] > 0  # prefixes the device pool had evicted
    assert m["vlserve:kv_offload_stores_total"] > 0
    assert m["vlserve:kv_offload_load_failures_total"] == 0
    # all at once: requests preempt each other in the tiny pool while others wait for or hold loaded blocks
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.check_integrity()


def test_host_tier_lru_evicts(qwen2_dir, reference):
    """A host tier of 6 blocks: it evicts, stays correct, and still hits."""
    prompts, expected, _ = reference
    per_block = 2 * 2 * BLOCK * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 KV heads, head dim 16, float32
    llm = _llm(
        qwen2_dir,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 6 * per_block},
        },
    )
    assert _run(llm, prompts) == expected
    m = llm.get_metrics()
    assert m["vlserve:kv_offload_host_blocks"] <= 6
    assert m["vlserve:kv_offload_evictions_total"] > 0
    llm.check_integrity()


def test_disk_tier_across_engines_and_corrupt_files(qwen2_dir, reference, tmp_path):
    prompts, expected, _ = reference
    first = _llm(qwen2_dir, kv_offloading_dir=str(tmp_path))
    assert _run(first, prompts[:4]) == expected[:4]
    files = glob.glob(os.path.join(str(tmp_path), "*", "rank0", "*.kvb"))
    assert files, "the disk tier wrote no block files"
    del first
    # a fresh engine (the host tier off) finds the first one's files
    second = _llm(qwen2_dir, kv_offloading_dir=str(tmp_path))
    assert _run(second, prompts[4:8]) == expected[4:8]
    m = second.get_metrics()
    assert m["vlserve:kv_offload_hit_tokens_total"] > 0
    assert m["vlserve:kv_offload_load_failures_total"] == 0
    # truncate / corrupt every file: a third engine warns, recomputes, and gets the same tokens
    for i, path in enumerate(glob.glob(os.path.join(str(tmp_path), "*", "rank0", "*.kvb"))):
        data = open(path, "rb").read()
        with open(path, "wb") as f:
            if i % 2:
                f.write(data[: len(data) - 7])  # truncated
            else:
                f.write(data[:-1] + bytes([data[-1] ^ 0xFF]))  # one flipped byte: the checksum catches it
    third = _llm(qwen2_dir, kv_offloading_dir=str(tmp_path))
    assert _run(third, prompts[8:]) == expected[8:]
    m = third.get_metrics()
    assert m["vlserve:kv_offload_load_failures_total"] > 0
    third.check_integrity()


def test_disk_full_recomputes(qwen2_dir, reference, tmp_path, monkeypatch):
    """Writes that fail (a full disk) leave the blocks off the disk tier; tokens do not change."""
    from vlserve.distributed.kv_transfer.offloading import tier_store

    real_open = open

    def full_disk_open(path, mode="r", *a, **kw):
        if "w" in mode and ".tmp" in os.path.basename(str(path)):  # the block file being written
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(tier_store, "open", full_disk_open, raising=False)
    prompts, expected, _ = reference
    llm = _llm(qwen2_dir, kv_offloading_dir=str(tmp_path))
    assert _run(llm, prompts) == expected
    m = llm.get_metrics()
    assert m["vlserve:kv_offload_store_failures_total"] > 0
    assert m["vlserve:kv_offload_disk_blocks"] == 0
    llm.check_integrity()


def _tier_files(root) -> list[str]:
    return glob.glob(os.path.join(str(root), "*", "rank0", "*.kvb"))


def test_disk_tier_size_cap_evicts_least_recently_used(qwen2_dir, reference, tmp_path):
    """--kv-offloading-dir-size: the files never take more than the cap (checked after every request), the least
    recently used go first (counted), tokens do not change; a later engine with a smaller cap deletes the oldest
    files it finds; a cap below one file is refused."""
    from transformers import AutoConfig

    from vlserve.engine.kv_transfer_setup import disk_file_bytes

    prompts, expected, _ = reference
    with pytest.raises(ValueError, match="less than one block file"):
        _llm(qwen2_dir, kv_offloading_dir=str(tmp_path), kv_offloading_dir_size=1e-9)
    per_file = disk_file_bytes(AutoConfig.from_pretrained(qwen2_dir), BLOCK, torch.float32)
    cap = 5 * per_file + per_file // 2
    llm = _llm(qwen2_dir, kv_offloading_dir=str(tmp_path), kv_offloading_dir_size=cap / (1 << 30))
    outs = []
    for p in prompts:
        outs.append(llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        files = _tier_files(tmp_path)
        assert all(os.path.getsize(f) == per_file for f in files)
        assert 0 < sum(os.path.getsize(f) for f in files) <= cap
    assert outs == expected
    m = llm.get_metrics()
    assert m["vlserve:kv_offload_disk_blocks"] == len(_tier_files(tmp_path)) == 5
    assert m["vlserve:kv_offload_disk_evictions_total"] == m["vlserve:kv_offload_stores_total"] - 5 > 0
    llm.check_integrity()
    del llm
    found = sorted(_tier_files(tmp_path))
    for i, f in enumerate(found):  # distinct mtimes: found[0] the oldest
        os.utime(f, ns=(1_000_000_000 * (i + 1), 1_000_000_000 * (i + 1)))
    small = _llm(qwen2_dir, kv_offloading_dir=str(tmp_path), kv_offloading_dir_size=2.5 * per_file / (1 << 30))
    m = small.get_metrics()
    assert m["vlserve:kv_offload_disk_evictions_total"] == 3 and m["vlserve:kv_offload_disk_blocks"] == 2
    assert _run(small, prompts[:1]) == expected[:1]  # its first step deleted the 3 oldest
    assert not set(found[:3]) & set(_tier_files(tmp_path)) and len(_tier_files(tmp_path)) <= 2


def test_async_scheduling_and_batched(qwen2_dir, reference):
    """The load step and the stores under async scheduling, all prompts in one batch: same tokens."""
    prompts, expected, _ = reference
    llm = _llm(qwen2_dir, kv_offloading_size=0.01, async_scheduling=True)
    assert _run(llm, prompts) == expected
    assert llm.get_metrics()["vlserve:kv_offload_hit_tokens_total"] > 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.check_integrity()


def test_eagle_head_layer_rides_in_the_tier(tmp_path_factory):
    """With an EAGLE head the tier keeps the head's KV layer too: a prefix loaded back from the tier drafts as well
    as one the device pool kept (same accepted drafts as an engine big enough to keep every prefix), same tokens."""
    from vlserve.demo.checkpoints import build_text_checkpoint
    from vlserve.spec_decode.eagle_heads import build_eagle_checkpoint

    root = tmp_path_factory.mktemp("tier_eagle")
    target = build_text_checkpoint(str(root / "t"), arch="qwen2", num_layers=1)
    spec = {
        "method": "eagle",
        "num_speculative_tokens": 3,
        "model": build_eagle_checkpoint(str(root / "h"), target, "eagle", "mimic"),
    }
    prompts = _workload()
    big = LLM(
        target, dtype="float32", num_kv_blocks=128, max_model_len=160, block_size=BLOCK, seed=0, speculative_config=spec
    )
    expected = _run(big, prompts)
    tier = _llm(target, kv_offloading_size=0.01, speculative_config=spec)
    assert _run(tier, prompts) == expected
    mb, mt = big.get_metrics(), tier.get_metrics()
    assert mt["vlserve:kv_offload_hit_tokens_total"] >= 4 * 64  # the second and third rounds' prefixes
    accepted = mb["vlserve:spec_decode_num_accepted_tokens_total"]
    assert accepted > 0 and abs(mt["vlserve:spec_decode_num_accepted_tokens_total"] - accepted) <= 0.1 * accepted
