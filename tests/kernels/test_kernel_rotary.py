"""apply_rotary parity with HF transformers (Llama RoPE and Qwen2-VL M-RoPE), and Triton vs reference."""

from __future__ import annotations

import pytest
import torch
from _kernel_testutils import to_device
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import rotate_half as hf_rotate_half
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

from vlserve.kernels.rotary_ref import apply_rotary_ref, build_rotary_cache

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

MAX_POS = 4096


def _llama_rope(head_dim, dtype):
    cfg = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=MAX_POS,
    )
    return LlamaRotaryEmbedding(cfg)


def _qwen2vl_rope(head_dim, mrope_section):
    cfg = Qwen2VLTextConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        max_position_embeddings=MAX_POS,
        rope_scaling={"type": "mrope", "mrope_section": mrope_section},
    )
    return Qwen2VLRotaryEmbedding(cfg)


def _hf_mrope_apply(q, k, cos, sin, mrope_section):
    """HF's M-RoPE on q/k `[1, H, T, D]`. transformers 4.x returns per-axis cos/sin `[3, 1, T, D]` and merges the
    sections in `apply_multimodal_rotary_pos_emb`; 5.x merges them in the rotary module (`[1, T, D]`)."""
    merge = getattr(modeling_qwen2_vl, "apply_multimodal_rotary_pos_emb", None)
    if merge is not None and cos.dim() == 4:
        return merge(q, k, cos, sin, mrope_section)
    return modeling_qwen2_vl.apply_rotary_pos_emb(q, k, cos, sin)


def _qk(num_tokens, head_dim, dtype, seed=0, hq=4, hkv=2):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_tokens, hq, head_dim, generator=g).to(dtype),
        torch.randn(num_tokens, hkv, head_dim, generator=g).to(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_hf_llama_exactly(dtype, head_dim):
    rope = _llama_rope(head_dim, dtype)
    positions = torch.tensor([0, 1, 2, 7, 100, 2047, 4095, 513])
    q, k = _qk(len(positions), head_dim, dtype)
    # HF: cos/sin [1, T, D] from the module, q/k as [1, H, T, D]
    cos, sin = rope(q.transpose(0, 1).unsqueeze(0), positions[None])
    hf_q, hf_k = hf_apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cos_cache, sin_cache = build_rotary_cache(rope.inv_freq, MAX_POS, rope.attention_scaling)
    torch.testing.assert_close(cos_cache[positions].to(dtype), cos[0, :, : head_dim // 2], atol=0, rtol=0)
    apply_rotary_ref(q, k, positions, cos_cache, sin_cache)
    assert torch.equal(q, hf_q[0].transpose(0, 1))
    assert torch.equal(k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,mrope_section", [(128, [16, 24, 24]), (64, [8, 12, 12]), (16, [2, 3, 3])])
def test_mrope_matches_hf_qwen2vl_exactly(dtype, head_dim, mrope_section):
    rope = _qwen2vl_rope(head_dim, mrope_section)
    g = torch.Generator().manual_seed(1)
    num_tokens = 23
    # text tokens (all axes equal) followed by an image grid (t, h, w differ), as Qwen2-VL lays them out
    text = torch.arange(5).expand(3, 5)
    grid = torch.stack([torch.full((18,), 5), 5 + torch.arange(18) // 6, 5 + torch.arange(18) % 6])
    positions = torch.cat([text, grid], dim=1)
    positions[:, -3:] = torch.randint(0, MAX_POS, (3, 3), generator=g)  # arbitrary, unequal axes
    q, k = _qk(num_tokens, head_dim, dtype, seed=2)
    cos, sin = rope(q.transpose(0, 1).unsqueeze(0), positions[:, None, :])  # [3, 1, T, D] or [1, T, D]
    hf_q, hf_k = _hf_mrope_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin, mrope_section)
    cos_cache, sin_cache = build_rotary_cache(rope.inv_freq, MAX_POS, rope.attention_scaling)
    apply_rotary_ref(q, k, positions, cos_cache, sin_cache, mrope_section)
    assert torch.equal(q, hf_q[0].transpose(0, 1))
    assert torch.equal(k, hf_k[0].transpose(0, 1))


def test_mrope_with_equal_axes_is_plain_rope():
    rope = _qwen2vl_rope(64, [8, 12, 12])
    cos_cache, sin_cache = build_rotary_cache(rope.inv_freq, MAX_POS)
    positions = torch.tensor([3, 9, 400, 0])
    q1, k1 = _qk(4, 64, torch.float32)
    q2, k2 = q1.clone(), k1.clone()
    apply_rotary_ref(q1, k1, positions, cos_cache, sin_cache)
    apply_rotary_ref(q2, k2, positions.expand(3, 4), cos_cache, sin_cache, [8, 12, 12])
    assert torch.equal(q1, q2) and torch.equal(k1, k2)


def test_partial_rotary_and_strided_views():
    # rotary on the first R=32 of D=64 dims; q/k are views into one fused qkv tensor
    rotary_dim, head_dim = 32, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos_cache, sin_cache = build_rotary_cache(inv_freq, 64)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, (4 + 2 + 2) * head_dim, generator=g)
    q = qkv[:, : 4 * head_dim].view(6, 4, head_dim)
    k = qkv[:, 4 * head_dim : 6 * head_dim].view(6, 2, head_dim)
    q0, k0, v0 = q.clone(), k.clone(), qkv[:, 6 * head_dim :].clone()
    positions = torch.tensor([0, 5, 6, 7, 30, 63])
    apply_rotary_ref(q, k, positions, cos_cache, sin_cache)
    cos = torch.cat([cos_cache[positions]] * 2, -1)[:, None]
    sin = torch.cat([sin_cache[positions]] * 2, -1)[:, None]
    for x, x0 in ((q, q0), (k, k0)):
        expected = x0[..., :rotary_dim] * cos + hf_rotate_half(x0[..., :rotary_dim]) * sin
        assert torch.equal(x[..., :rotary_dim], expected)
        assert torch.equal(x[..., rotary_dim:], x0[..., rotary_dim:])
    assert torch.equal(qkv[:, 6 * head_dim :], v0)


@pytest.mark.parametrize("mrope_section", [None, [8, 12, 12]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_triton_matches_ref(triton_kernels, device, mrope_section, dtype):
    head_dim = 80 if mrope_section is None else 64  # 80: non-power-of-two head dim, R/2 = 40
    rotary_dim = head_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos_cache, sin_cache = build_rotary_cache(inv_freq, 512)
    g = torch.Generator().manual_seed(4)
    if mrope_section is None:
        positions = torch.randint(0, 512, (7,), generator=g)
    else:
        positions = torch.randint(0, 512, (3, 7), generator=g)
    q, k = _qk(7, head_dim, dtype, seed=5, hq=6, hkv=2)
    q2, k2, pos2, cos2, sin2 = to_device(device, q, k, positions, cos_cache, sin_cache)
    apply_rotary_ref(q, k, positions, cos_cache, sin_cache, mrope_section)
    triton_kernels.rotary.apply_rotary_triton(q2, k2, pos2, cos2, sin2, mrope_section)
    if dtype != torch.float32:
        tol = dict(atol=2e-2, rtol=1e-2)
    elif device.type == "cuda":
        tol = dict(atol=1e-5, rtol=1e-5)  # the compiled kernel may fuse x*cos - y*sin into one FMA
    else:
        tol = dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q2.cpu(), q, **tol)
    torch.testing.assert_close(k2.cpu(), k, **tol)
