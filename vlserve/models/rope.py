"""RoPE inverse frequencies for every rope type vlserve loads (our own code; transformers only supplies configs).

Each function returns `(inv_freq [R/2] float32, attention_scaling)`, computed with the same float32 operations
as the reference formulas (so cos/sin tables match HF's to the bit). `R = int(head_dim * partial_rotary_factor)`.
Every type here has frequencies that are fixed for all positions below `max_position_embeddings` (the longest
context vlserve serves), so one table computed at load time is exact:
- default: `theta ** (-2i / R)`;
- linear: default / factor;
- dynamic (NTK): default, since HF rescales the base only for sequences longer than max_position_embeddings;
- llama3: low frequencies divided by factor, high ones kept, a smooth blend in between;
- yarn: a ramp between interpolated (/factor) and original frequencies, plus a magnitude `attention_scaling`.
M-RoPE (Qwen2-VL) uses default frequencies; its `mrope_section` only splits them across the 3 position axes.
"""

from __future__ import annotations

import math

import torch

from vlserve.models.hf_config import RopeParams

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _rotary_dim(p: RopeParams) -> int:
    return int(p.head_dim * p.partial_rotary_factor)


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # [dim/2] float32: 1 / theta^(2i/dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def _required(p: RopeParams, key: str):
    if p.scaling.get(key) is None:
        raise ValueError(
            f"rope type {p.rope_type!r} needs {key!r} in the config's rope parameters (got keys {sorted(p.scaling)})"
        )
    return p.scaling[key]


def _default(p: RopeParams) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(p.theta, _rotary_dim(p)), 1.0


def _linear(p: RopeParams) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(p.theta, _rotary_dim(p)) / float(_required(p, "factor")), 1.0


def _dynamic(p: RopeParams) -> tuple[torch.Tensor, float]:
    # NTK base at seq_len = max_position_embeddings: theta * (factor * 1 - (factor - 1)) ** (dim / (dim - 2)).
    dim, factor, max_pos = _rotary_dim(p), float(_required(p, "factor")), p.max_position_embeddings
    base = p.theta * ((factor * max_pos / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim), 1.0


def _llama3(p: RopeParams) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(p.theta, _rotary_dim(p))  # [R/2]
    factor = float(_required(p, "factor"))
    low, high = float(_required(p, "low_freq_factor")), float(_required(p, "high_freq_factor"))
    old_len = p.scaling.get("original_max_position_embeddings") or p.max_position_embeddings
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(p: RopeParams) -> tuple[torch.Tensor, float]:
    dim, s = _rotary_dim(p), p.scaling
    original = s.get("original_max_position_embeddings") or p.max_position_embeddings
    factor = s.get("factor")
    if factor is None:  # DeepSeek-style configs give only the two lengths
        factor = p.max_position_embeddings / original
    factor = float(factor)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension index that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(p.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [R/2]
    pos_freqs = p.theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)  # [R/2]
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 = keep the original frequency (high frequencies), 0 = fully interpolated
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


_INIT = {"default": _default, "linear": _linear, "dynamic": _dynamic, "llama3": _llama3, "yarn": _yarn}


def rope_inv_freq(p: RopeParams) -> tuple[torch.Tensor, float]:
    """`(inv_freq [R/2] float32 on CPU, attention_scaling)` for `p`; ValueError naming an unsupported type."""
    init = _INIT.get(p.rope_type)
    if init is None:
        raise ValueError(f"rope type {p.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    with torch.device("cpu"):  # overrides an enclosing meta-device context
        inv_freq, scaling = init(p)
    return inv_freq.to(torch.float32), float(scaling)
