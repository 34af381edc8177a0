"""Building blocks shared by the decoder models: RMSNorm (with fused residual add), gated MLP, RoPE.

All tensors are flattened over the step: `T` tokens, `H` hidden size, no batch dimension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlserve import kernels
from vlserve.kernels.activation import activation
from vlserve.kernels.cpu_linear import PANEL
from vlserve.kernels.rms_norm_cpu import rms_norm
from vlserve.kernels.rotary_ref import rotary_cos_sin
from vlserve.kernels.silu_mul_cpu import silu_mul
from vlserve.models.hf_config import RopeParams, rope_params_of
from vlserve.models.parallel_layers import MergedColumnParallelLinear, RowParallelLinear
from vlserve.models.rope import rope_inv_freq


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: statistics in float32, cast back to the input dtype, then scaled by `weight`.

    `forward(x, residual=None)`: with a residual, computes `s = x + residual` (in the input dtype, like HF's
    `residual + hidden_states`) and returns `(norm(s), s)`; without one it returns `norm(x)`. On CPU rows both
    run as one C++ pass (`kernels.rms_norm_cpu`), the same roundings but the order of the float32 sum; float32 rows
    stay on torch's ops where `float32_on_torch` (set under activation quantization).
    """

    float32_on_torch = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., H] -> [..., H] (same dtype as x). Plain torch ops on purpose: eager runs them one by one (HF's
        # exact arithmetic); a compiled forward fuses the add, the float32 statistics and the scale into one kernel.
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def _fused(self, x: torch.Tensor, residual: torch.Tensor | None):
        if self.float32_on_torch and x.dtype is torch.float32:
            return None
        return rms_norm(x, self.weight, self.eps, residual)  # one C++ pass on CPU rows; None elsewhere

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        fused = self._fused(x, residual)
        if fused is not None:
            return fused
        if residual is None:
            return self._norm(x)
        s = residual + x
        return self._norm(s), s

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up fused into one Linear (`gate_up_proj`, weight [2I, H]).

    Under tensor parallelism gate_up is column-parallel and down_proj row-parallel: `intermediate_size` is this
    rank's `I / tp`, and down_proj sums the ranks' outputs."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=bias
        )
        self.intermediate_size = self.gate_up_proj.piece_offsets["up_proj"][1]  # this rank's I / tp
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.hidden_act = hidden_act
        self.act_fn = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> gate_up: [T, 2I] -> [T, I] -> [T, H]
        proj = self.gate_up_proj
        if self.hidden_act in ("silu", "swish") and self.intermediate_size % PANEL == 0:
            fused = proj.silu_mul(x, self.intermediate_size)  # silu(gate) * up in the kernel's pass, where one does
            if fused is not None:
                return self.down_proj(fused)
        gate_up = proj(x)
        if self.hidden_act in ("silu", "swish"):
            fused = silu_mul(gate_up, self.intermediate_size)  # one C++ pass over CPU rows; None elsewhere
            if fused is not None:
                return self.down_proj(fused)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.hidden_act == "silu":
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(self.act_fn(gate) * up)


def compute_inv_freq(config) -> tuple[torch.Tensor, float]:
    """`(inv_freq [R/2] float32, attention_scaling)` for the text config's rope settings (see vlserve.models.rope).

    Raises ValueError naming an unsupported rope type and listing the supported ones.
    """
    return rope_inv_freq(rope_params_of(config))


def build_rope_cache(
    inv_freq: torch.Tensor, attention_scaling: float, max_positions: int, dtype: torch.dtype, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[max_positions, R/2]` computed exactly like HF (float32 outer product, scale, cast)."""
    # inv_freq: [R/2] float32; pos: [P] float32 -> freqs [P, R/2]
    with torch.device("cpu"):  # overrides an enclosing meta-device context
        pos = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = pos[:, None] * inv_freq.to("cpu", torch.float32)[None, :]
        cos = (freqs.cos() * attention_scaling).to(dtype)
        sin = (freqs.sin() * attention_scaling).to(dtype)
    return cos.to(device), sin.to(device)


def _rotate_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, R/2] -> [T, H, D]; the same op order and dtypes as kernels' rotary_ref
    half = cos.shape[-1]
    cos = cos.to(x.dtype).unsqueeze(1)  # [T, 1, R/2]
    sin = sin.to(x.dtype).unsqueeze(1)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin tables of one model and applies NeoX-style RoPE in place via `kernels.apply_rotary`.

    Tables are non-persistent buffers `cos_cache`/`sin_cache` `[max_position_embeddings, R/2]` in the model dtype
    (HF casts cos/sin to the activation dtype before multiplying). `mrope_section` (from
    the config's rope parameters) switches on M-RoPE, where positions are `[3, T]`. `params` overrides the config's
    RoPE settings (Gemma 3 gives each layer type its own table).
    """

    def __init__(
        self,
        config,
        max_positions: int | None = None,
        dtype: torch.dtype | None = None,
        params: RopeParams | None = None,
    ) -> None:
        super().__init__()
        params = params if params is not None else rope_params_of(config)
        inv_freq, scaling = rope_inv_freq(params)
        self.rotary_dim = 2 * inv_freq.numel()
        self.max_positions = int(max_positions or config.max_position_embeddings)
        self.mrope_section = list(params.mrope_section) if params.mrope_section is not None else None
        self.mrope_interleaved = params.mrope_interleaved  # Qwen3-VL (a model may also switch it on)
        self._step_tables: tuple | None = None  # (positions, cos [T, R/2], sin) of the last interleaved call
        self._inv_freq = inv_freq
        self._scaling = scaling
        dtype = dtype or torch.get_default_dtype()
        device = torch.get_default_device()
        if device.type == "meta":  # built for the loader: `init_buffers` fills the tables after `to_empty`
            cos = torch.empty(self.max_positions, self.rotary_dim // 2, dtype=dtype)
            sin = torch.empty_like(cos)
        else:
            cos, sin = build_rope_cache(inv_freq, scaling, self.max_positions, dtype, device)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    @torch.no_grad()
    def init_buffers(self, device=None, dtype: torch.dtype | None = None) -> None:
        """(Re)compute the tables on `device` (used after `to_empty` when the model was built on meta)."""
        device = device if device is not None else self.cos_cache.device
        dtype = dtype or self.cos_cache.dtype
        self.cos_cache, self.sin_cache = build_rope_cache(
            self._inv_freq, self._scaling, self.max_positions, dtype, device
        )

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
        """Rotate `query [T,Hq,D]` and `key [T,Hkv,D]` in place at `positions` ([T] or [3,T] int64)."""
        if positions.dim() == 2 and self.mrope_section is None:
            raise ValueError("positions of shape [3, T] need an 'mrope_section' in the config's rope parameters")
        mrope = self.mrope_section if positions.dim() == 2 else None
        if mrope is not None and self.mrope_interleaved:
            # the kernels take contiguous sections: gather this step's per-token tables once (every layer of the
            # step passes the same positions tensor) and rotate token t at row t of them
            if self._step_tables is None or self._step_tables[0] is not positions:
                cos, sin = rotary_cos_sin(positions, self.cos_cache, self.sin_cache, mrope, interleaved=True)
                rows = torch.arange(positions.shape[1], device=positions.device)  # [T]
                self._step_tables = (positions, cos, sin, rows)
            _, cos, sin, rows = self._step_tables
            kernels.apply_rotary(query, key, rows, cos, sin)
            return
        kernels.apply_rotary(query, key, positions, self.cos_cache, self.sin_cache, mrope)

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Out-of-place twin of `forward` in plain torch, for compiled forwards (inductor fuses the table gather,
        the casts and the rotation into one kernel per tensor): returns rotated `(query, key)`."""
        mrope = self.mrope_section if positions.dim() == 2 else None
        cos, sin = rotary_cos_sin(
            positions, self.cos_cache, self.sin_cache, mrope, interleaved=self.mrope_interleaved
        )  # [T, R/2] each
        return _rotate_native(query, cos, sin), _rotate_native(key, cos, sin)

    def extra_repr(self) -> str:
        return (
            f"rotary_dim={self.rotary_dim}, max_positions={self.max_positions}, mrope={self.mrope_section}"
            f"{', interleaved' if self.mrope_interleaved else ''}"
        )
