"""The torch decode path's scratch buffer belongs to the model runner: sized once, passed in the step's metadata."""

from __future__ import annotations

import torch

import vlserve.kernels.attention_ref as attention_ref
from vlserve import LLM, SamplingParams
from vlserve.demo.checkpoints import build_text_checkpoint
from vlserve.kernels import BACKEND_ENV, cpu_decode, decode_workspace_numel, paged_attention_decode_ref


def _paged_case(seq_lens, block_size=4, heads=(4, 2), head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    k_cache = torch.randn(num_blocks, block_size, heads[1], head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, heads[1], head_dim, generator=g)
    tables, nxt = [], 0
    width = max(-(-n // block_size) for n in seq_lens)
    for n in seq_lens:
        nb = -(-n // block_size)
        tables.append(list(range(nxt, nxt + nb)) + [0] * (width - nb))
        nxt += nb
    query = torch.randn(len(seq_lens), heads[0], head_dim, generator=g)
    return query, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)


def test_decode_same_with_or_without_a_workspace():
    q, k, v, tables, lens = _paged_case([5, 13, 1, 9])
    plain = paged_attention_decode_ref(q, k, v, tables, lens, 0.3)
    big = torch.full((decode_workspace_numel(16, 4, 2, 8, 4),), float("nan"))  # stale contents must not matter
    with_ws = paged_attention_decode_ref(q, k, v, tables, lens, 0.3, workspace=big)
    too_small = paged_attention_decode_ref(q, k, v, tables, lens, 0.3, workspace=torch.empty(3))  # falls back
    assert torch.equal(plain, with_ws) and torch.equal(plain, too_small)
    assert not any(isinstance(v, torch.Tensor) or type(v).__name__ == "_local" for v in vars(attention_ref).values())


def test_runner_passes_its_workspace_to_decode(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "0")  # the torch decode path, not the C++ kernel, reads the workspace
    monkeypatch.setenv(BACKEND_ENV, "torch")  # on CUDA too (its default, Triton, needs no workspace)
    path = build_text_checkpoint(str(tmp_path / "m"))
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4)
    runner = llm.engine.runner
    ws = runner.attn_workspace
    assert ws is not None and ws.dtype == torch.float32
    _, bs, h, d = runner.kv_cache_shape(1)
    assert ws.numel() == decode_workspace_numel(min(64 * bs, runner.text_config.max_position_embeddings), bs, h, d, 4)
    seen = []
    real = attention_ref.paged_attention_decode_ref

    def spy(*args, **kwargs):
        seen.append(kwargs.get("workspace") is ws)
        return real(*args, **kwargs)

    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = llm.generate(["Hello there", "A"], sp, use_tqdm=False)
    monkeypatch.setattr(attention_ref, "paged_attention_decode_ref", spy)
    got = llm.generate(["Hello there", "A"], sp, use_tqdm=False)
    assert seen and all(seen)  # every decode call got the runner's own buffer
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    llm.check_integrity()
