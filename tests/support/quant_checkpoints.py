"""Quantized copies of the tiny test checkpoints, packed the way each format's documentation and tools lay them
out (round-to-nearest, no calibration): compressed-tensors (W4A16 / W8A16 sym and asym, group or channel, act
order; W8A8 INT8; FP8 per channel, per tensor or per block), GPTQ (v1 zero points, 4 / 8 bits, desc_act) and AWQ
(GEMM). For tests that need shapes or options the committed fixtures (`tests/fixtures/quant`, made by
llm-compressor and GPTQModel) do not have; transformers loads the compressed-tensors ones as its own check.

Only the language decoder's projections (`*.layers.N.self_attn.{q,k,v,o}_proj`, `*.layers.N.mlp.*_proj`) are
quantized; everything else keeps its float tensors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib

import torch
from safetensors.torch import load_file, save_file

from vlserve.kernels.kv_quant import FP8_MAX
from vlserve.models.quantization.packing import AWQ_ORDER, pack_int32, unpack_int32

_DECODER_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
_TOWER = re.compile(r"vision|visual|audio")  # CLIP / Whisper towers have `layers.N.self_attn.q_proj` too


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """[O, I] -> [O, I / group, group] (group = I: one group a row)."""
    return w.reshape(w.shape[0], -1, group)


def _int_qparams(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    """Round-to-nearest integer quantization of w [O, I] in groups: (unsigned q [O, I], scales [O, G], unsigned
    zeros [O, G]) with w ~ (q - z) * s."""
    g = _groups(w.float(), group)
    top = (1 << bits) - 1
    if symmetric:
        s = g.abs().amax(-1).clamp(min=1e-8) / ((1 << (bits - 1)) - 1)  # [O, G]
        z = torch.full_like(s, 1 << (bits - 1))
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = ((hi - lo) / top).clamp(min=1e-8)
        z = torch.round(-lo / s).clamp(0, top)
    q = torch.round(g / s[..., None] + z[..., None]).clamp(0, top)
    return q.reshape(w.shape).to(torch.uint8), s, z.to(torch.uint8)


def _ct_wna16(w, bits, group, symmetric, actorder, rng):
    """compressed-tensors pack-quantized tensors of one linear."""
    out, inp = w.shape
    perm = torch.randperm(inp, generator=rng) if actorder else None
    g_idx = None
    if perm is not None:  # column perm[j] falls in group j // group: groups gather scattered columns
        g_idx = torch.empty(inp, dtype=torch.int32)
        g_idx[perm] = torch.arange(inp, dtype=torch.int32) // group
        q_sorted, s, z = _int_qparams(w[:, perm], bits, group, symmetric)
        q = torch.empty_like(q_sorted)
        q[:, perm] = q_sorted
    else:
        q, s, z = _int_qparams(w, bits, group, symmetric)
    t = {
        "weight_packed": pack_int32(q, bits, 1),
        "weight_scale": s.to(torch.float32),
        "weight_shape": torch.tensor([out, inp]),
    }
    if not symmetric:
        t["weight_zero_point"] = pack_int32(z, bits, 0)
    if g_idx is not None:
        t["weight_g_idx"] = g_idx
    return t


def _fp8(w, strategy, block):
    """compressed-tensors float-quantized tensors of one linear."""
    wf = w.float()
    if strategy == "tensor":
        s = wf.abs().amax().clamp(min=1e-8).reshape(1) / FP8_MAX
        q = (wf / s).clamp(-FP8_MAX, FP8_MAX)
    elif strategy == "channel":
        s = wf.abs().amax(-1, keepdim=True).clamp(min=1e-8) / FP8_MAX  # [O, 1]
        q = (wf / s).clamp(-FP8_MAX, FP8_MAX)
    else:
        bn, bk = block
        blocks = wf.reshape(wf.shape[0] // bn, bn, wf.shape[1] // bk, bk)
        s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / FP8_MAX  # [O/bn, I/bk]
        q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(wf.shape)
    return {"weight": q.to(torch.float8_e4m3fn), "weight_scale": s.to(torch.float32)}


def _gptq(w, bits, group, desc_act, rng):
    """GPTQ (v1: zero - 1 stored) tensors of one linear: qweight [I*b/32, O], qzeros, scales [G, O], g_idx."""
    out, inp = w.shape
    t = _ct_wna16(w, bits, group, False, desc_act, rng)  # the same rounding, read back from its packs
    q = unpack_int32(t["weight_packed"], bits, 1, inp)  # [O, I]
    z = unpack_int32(t["weight_zero_point"], bits, 0, out)  # [O, G]
    g_idx = t.get("weight_g_idx", torch.arange(inp, dtype=torch.int32) // group)
    stored_z = ((z.to(torch.int16) - 1) & ((1 << bits) - 1)).to(torch.uint8)  # v1 format: zero - 1
    return {
        "qweight": pack_int32(q.t().contiguous(), bits, 0),
        "qzeros": pack_int32(stored_z.t().contiguous(), bits, 1),
        "scales": t["weight_scale"].t().contiguous().to(torch.float16),
        "g_idx": g_idx.to(torch.int32),
    }


def _awq(w, group):
    """AWQ GEMM tensors of one linear: qweight [I, O/8], qzeros [G, O/8] (interleaved nibbles), scales [G, O]."""
    q, s, z = _int_qparams(w, 4, group, False)
    return {
        "qweight": pack_int32(q.t().contiguous(), 4, 1, AWQ_ORDER),
        "qzeros": pack_int32(z.t().contiguous(), 4, 1, AWQ_ORDER),
        "scales": s.t().contiguous().to(torch.float16),
    }


def _ct_config(weights: dict, acts: dict | None, fmt: str) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": [
            "lm_head",
            "re:.*visual.*",
            "re:.*vision_tower.*",
            "re:.*multi_modal_projector.*",
            "re:.*audio_tower.*",
        ],
        "kv_cache_scheme": None,
    }


def _int_args(bits, strategy, group, symmetric, actorder=None) -> dict:
    return {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": strategy,
        "group_size": group if strategy == "group" else None,
        "dynamic": False,
        "actorder": actorder,
        "observer": "minmax",
    }


def dequantize(tensors: dict[str, torch.Tensor], scheme: str, shape: tuple[int, int], group: int) -> torch.Tensor:
    """The float32 [O, I] weight one linear's packed tensors stand for (read back through the format's unpacking,
    independent of how the loader does it)."""
    out, inp = shape
    if scheme.startswith("ct-fp8"):
        w, s = tensors["weight"].float(), tensors["weight_scale"]
        if s.dim() == 2 and s.shape[1] > 1:
            return w * s.repeat_interleave(out // s.shape[0], 0).repeat_interleave(inp // s.shape[1], 1)
        return w * s
    if scheme == "ct-w8a8":
        return tensors["weight"].float() * tensors["weight_scale"]
    if scheme.startswith("ct-w"):
        bits = 8 if scheme.startswith("ct-w8") else 4
        q = unpack_int32(tensors["weight_packed"], bits, 1, inp).float()
        s = tensors["weight_scale"].float()
        z = (
            unpack_int32(tensors["weight_zero_point"], bits, 0, out).float()
            if "weight_zero_point" in tensors
            else torch.full_like(s, 1 << (bits - 1))
        )
        g_idx = tensors.get("weight_g_idx")
        cols = g_idx.long() if g_idx is not None else torch.arange(inp) // (inp // s.shape[1])
        return (q - z[:, cols]) * s[:, cols]
    if scheme.startswith("gptq"):
        bits = int(scheme.split("-")[1])
        q = unpack_int32(tensors["qweight"], bits, 0, inp).float().t()  # [O, I]
        z = ((unpack_int32(tensors["qzeros"], bits, 1, out).long() + 1) & ((1 << bits) - 1)).float().t()  # [O, G]
        s = tensors["scales"].float().t()
        cols = tensors["g_idx"].long()
        return (q - z[:, cols]) * s[:, cols]
    if scheme == "awq":
        q = unpack_int32(tensors["qweight"], 4, 1, out, AWQ_ORDER).float().t()
        z = unpack_int32(tensors["qzeros"], 4, 1, out, AWQ_ORDER).float().t()
        s = tensors["scales"].float().t()
        cols = torch.arange(inp) // group
        return (q - z[:, cols]) * s[:, cols]
    raise ValueError(f"unknown scheme {scheme!r}")


def quantize_checkpoint(
    src: str,
    dst: str,
    scheme: str,
    group_size: int = 64,
    seed: int = 0,
    block: tuple[int, int] = (64, 64),
    dequantized_dst: str | None = None,
) -> str:
    """Copy checkpoint `src` to `dst` with its decoder projections quantized by `scheme`: "ct-w4a16",
    "ct-w4a16-asym", "ct-w4a16-actorder", "ct-w4a16-channel", "ct-w8a16", "ct-w8a8", "ct-fp8", "ct-fp8-tensor",
    "ct-fp8-block", "gptq-4", "gptq-8", "gptq-4-actorder", "awq". With `dequantized_dst`, also write a float
    copy of `src` whose projections hold the dequantized weights (for transformers to run as the oracle)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    if dequantized_dst is not None:
        shutil.rmtree(dequantized_dst, ignore_errors=True)
        shutil.copytree(src, dequantized_dst)
    files = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    for f in files:
        tensors = load_file(os.path.join(dst, f))
        out: dict[str, torch.Tensor] = {}
        float_copy = dict(tensors)
        for name, w in tensors.items():
            if not _DECODER_LINEAR.search(name) or _TOWER.search(name):
                out[name] = w
                continue
            module = name[: -len(".weight")]
            # projections that read the same input share one act order (as GPTQ's Hessian makes them)
            shared = re.sub(r"(q|k|v)_proj$", "qkv", re.sub(r"(gate|up)_proj$", "gate_up", module))
            rng = torch.Generator().manual_seed(seed + zlib.crc32(shared.encode()))
            packed = _quantize_one(w, scheme, group_size, block, rng)
            for suffix, t in packed.items():
                out[f"{module}.{suffix}"] = t
            float_copy[name] = dequantize(packed, scheme, tuple(w.shape), group_size).to(w.dtype).contiguous()
        save_file(out, os.path.join(dst, f), metadata={"format": "pt"})
        if dequantized_dst is not None:
            save_file(float_copy, os.path.join(dequantized_dst, f), metadata={"format": "pt"})
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = _quant_config(scheme, group_size, block)
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2)
    return dst


def _quantize_one(w, scheme, group, block, rng) -> dict[str, torch.Tensor]:
    if scheme.startswith("ct-w") and scheme != "ct-w8a8":
        bits = 8 if scheme.startswith("ct-w8") else 4
        g = w.shape[1] if scheme.endswith("channel") else group
        return _ct_wna16(w, bits, g, not scheme.endswith("asym"), scheme.endswith("actorder"), rng)
    if scheme == "ct-w8a8":
        s = w.float().abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0
        return {"weight": torch.round(w.float() / s).clamp(-128, 127).to(torch.int8), "weight_scale": s}
    if scheme.startswith("ct-fp8"):
        strategy = {"ct-fp8": "channel", "ct-fp8-tensor": "tensor", "ct-fp8-block": "block"}[scheme]
        return _fp8(w, strategy, block)
    if scheme.startswith("gptq"):
        return _gptq(w, int(scheme.split("-")[1]), group, scheme.endswith("actorder"), rng)
    if scheme == "awq":
        return _awq(w, group)
    raise ValueError(f"unknown scheme {scheme!r}")


def _quant_config(scheme: str, group: int, block: tuple[int, int]) -> dict:
    if scheme == "ct-w8a8":
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
        return _ct_config(_int_args(8, "channel", None, True), acts, "int-quantized")
    if scheme.startswith("ct-fp8"):
        strategy = {"ct-fp8": "channel", "ct-fp8-tensor": "tensor", "ct-fp8-block": "block"}[scheme]
        weights = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": strategy,
            "dynamic": False,
            "block_structure": list(block) if strategy == "block" else None,
        }
        acts = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "dynamic": True,
            "strategy": "group" if strategy == "block" else "token",
            "group_size": block[1] if strategy == "block" else None,
        }
        return _ct_config(weights, acts, "float-quantized")
    if scheme.startswith("ct-w"):
        bits = 8 if scheme.startswith("ct-w8") else 4
        strategy = "channel" if scheme.endswith("channel") else "group"
        return _ct_config(
            _int_args(
                bits, strategy, group, not scheme.endswith("asym"), "group" if scheme.endswith("actorder") else None
            ),
            None,
            "pack-quantized",
        )
    if scheme.startswith("gptq"):
        return {
            "quant_method": "gptq",
            "bits": int(scheme.split("-")[1]),
            "group_size": group,
            "desc_act": scheme.endswith("actorder"),
            "sym": False,
            "checkpoint_format": "gptq",
        }
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    raise ValueError(f"unknown scheme {scheme!r}")
