"""Quantized linear layers' matmuls: `y = x W^T + b` with W held quantized (the kernels under
`models.quantization`'s schemes).

Three families, each as a `prepare_*` (run once, after loading: canonical tensors -> the layout the kernel of this
device reads) and a `*_linear` that multiplies; each has a `*_ref` twin in plain torch that states the math:
- W8A8 INT8 (`prepare_int8` / `int8_linear`): int8 weights with a float scale per output channel; the activations
  are quantized to int8 per token at run time (symmetric, scale absmax / 127.5 as compressed-tensors defines it), the
  products summed in int32.
- WNA16 (`prepare_wna16` / `wna16_linear`): 4- or 8-bit integer weights in groups along the input dim, each group
  with a float scale and an integer zero point (`w = (q - z) * s`); activations stay float. GPTQ's act order (a
  `g_idx` that maps each input column to its group) becomes a permutation of the input columns, applied to x.
- FP8 (`prepare_fp8` / `fp8_linear`): float8_e4m3fn weights with a scale per tensor, per output channel or per
  block; activations quantized to fp8 per token (or per group of columns) at run time, or with a static scale.

Canonical inputs (what the checkpoint formats are unpacked to): `q` uint8 [N, K] holding unsigned values in
[0, 2^bits), `scales` float [N, G] and `zeros` int [N, G] with G = K / group_size groups along the input dim.

What runs where:
- CUDA tensors: the references here; the model's schemes (`models.quantization.schemes`) send CUDA layers to
  `quant_linear_cuda` instead (Triton W4A16 / W8A16, `_int_mm`, `_scaled_mm`).
- CPU tensors where `quant_linear_cpu.quant_kernel()` builds (AVX2 + FMA or AVX-512): `prepare_*` pack the weights
  once into the C++ kernel's panels (`cpu`; the canonical tensors stay unless `keep_canonical=False`, which the
  model's schemes pass, so a served layer holds its weights once) and `*_linear` run csrc/quant_linear*.cpp,
  float32 sums, one rounding to x.dtype (float16 x through float32). WNA16: 4- or 8-bit values widened to float32
  in registers; at 1-2 rows (decode) each group's x . (q - z) (and, convert, subtract, FMA per 8 weights) times the
  group's scale, at more rows each weight exactly as `dequantize_wna16_ref` makes it, a 128-deep K block at a time,
  into cpu_linear's float32 register blocks: within float32 rounding of the reference. INT8: x quantized in C++
  exactly as `quantize_rows_int8`, int8 products summed in int32 through int16 pairs (vpmaddwd; vpdpwssd where the
  CPU has AVX512-VNNI), rescaled as the reference: bit-identical to it. FP8: no FP8 math on these CPUs, so the e4m3
  weights are decoded to float32 in registers (a shift, a shift, a mask and the scale multiply per 8) and x is
  rounded through e4m3 in C++ exactly as `quantize_fp8_ref`. Layouts the kernel cannot hold (WNA16 groups that are
  not a multiple of 8 positions, FP8 block columns likewise, FP8 scales of 256 or more) are not packed: the
  references run.
- CPUs with AMX (2-core Xeon figures in docs/benchmarks.md): W8A8 runs on the int8 tile unit at every row count
  (csrc/quant_linear_amx_int8.cpp: the matrix packed once in the tile layout, held instead of the pair layout; x
  quantized as the reference; tdpbssd's exact int32 sums, the reference's epilogue: bit-equal to it). Where that
  build or the tile state is missing, inputs of 16+ rows go to oneDNN's int8 matmul on the matrix prepacked at load
  (`quant_linear_cpu.prepack_int8_onednn`) with the row quantization and the epilogue in C++ (bit-equal too).
  WNA16 bf16 inputs of 4+ rows run on the bf16 tile unit, the weights rounded to bf16 as `wna16_linear_ref(...,
  weight_dtype=torch.bfloat16)` states: 4-bit ones by table lookup (csrc/quant_linear_amx_int4.cpp: the 16 bf16
  values of each column's group computed once per call, a vpermw per 32 weights, the matrix as the A operand), 8-bit
  ones and groups of 8 or 16 positions dequantized a panel at a time (csrc/quant_linear_amx.cpp); tdpbf16ps; so do FP8 bf16 inputs where the matrix has one scale per column and x is
  rounded per token or by a static scale (the e4m3 weights and x's e4m3 values are exact in bf16; the row and
  column scales multiply the float32 sums: within float32 rounding of the reference), at every row count. Rows are
  independent: a row's output never depends on the other rows of its call. The tile unit's sums are not the
  register kernel's bit for bit (tdpbf16ps rounds inside its dot products), and FP8 activations turn a one-ulp
  difference into an e4m3 step in the next layer, so each FP8 matrix takes one path for all row counts (the tiles
  where they serve it: slower than the register kernel at a few rows, faster from about 8 on); all other FP8
  layouts and float32 x take the register kernel, whose 1-2 row and block paths sum in the same order.
- AVX-512 CPUs build the same AVX2 source with inductor's AVX-512 flags and -march=native (EVEX encodings, 32
  vector registers, vpdpwssd with VNNI): the tests run both builds there. There WNA16's 1-2 row kernel runs on
  16-lane zmm registers (the same operations per column as the 8-lane one); the other register kernels stay 8 wide. torch's own candidates lost on AVX2 (bf16 x, hot, ms at 4864x896 M=1 / 32
  and 18944x3584 M=1 / 32): `_weight_int4pack_mm_for_cpu` 0.31 / 3.2 / 4.9 / 50 against W4A16's 0.13 / 1.7 / 2.4 /
  27 here (and it keeps scales and zeros in x's dtype, so bf16 x rounds them: not float32's accuracy; float32 x
  takes a slow path, 11 ms at 4864x896 M=1); `_weight_int8pack_mm` (weight-only) 0.17 / 3.2 / 3.9 / 55 against
  W8A8's 0.12 / 1.0 / 2.9 / 17; `torch._int_mm` is a plain loop on this CPU (24 ms at 4864x896 M=1); oneDNN's
  qlinear takes one scale for all of x, not one a token. Whether `_int_mm` reaches oneDNN on AVX512-VNNI / AMX CPUs
  was not checked.
- Measured (`benchmarks/quant_linear.py --stat min`, 2 Zen 3 cores shared with other jobs; float32 and bf16 x
  alike), speed against the packed bf16 `cpu_linear` at M = 1 / 8 / 32 / 512 on the 0.5B MLP and 7B shapes (hot):
  W4A16 g128 1.6-2.0x / 1.15-1.23x / 0.99-1.04x / 0.98-1.07x, W8A8 INT8 1.9-2.1x / 2.0-2.1x / 1.6-1.7x / 1.5-1.7x,
  FP8 (per channel or 128x128 blocks) 1.45-1.75x / 1.15-1.24x / 0.98-1.06x / 0.96-1.09x. At the 0.5B's small qkv
  and o (896-1152 x 896, bf16 matrices that stay in L3 when hot) hot M=1 gave W4A16 1.05-1.5x, FP8 0.9-1.4x, INT8
  2.0x; with the caches flushed before each call, as a decode step's weights are (`--cold`), M=1 ran W4A16
  1.7-2.0x, INT8 1.7-2.4x, FP8 1.4-2.1x as fast on all five shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlserve.kernels import quant_linear_cpu as QC
from vlserve.kernels.cpu_linear import onednn_min_rows, onednn_takes
from vlserve.kernels.kv_quant import FP8_MAX  # the largest finite float8_e4m3fn
from vlserve.kernels.quant_linear_cpu import PackedQuant


def _packs_here(weight: torch.Tensor) -> bool:
    """Whether `prepare_*` packs this canonical weight for the C++ CPU kernel: a CPU tensor and a kernel built."""
    return weight.device.type == "cpu" and QC.quant_kernel() is not None


# ----------------------------------------------------------------------------------------------------- W8A8 INT8


@dataclass
class Int8Weights:
    """A W8A8 matrix: `weight` int8 [N, K], `scale` float32 [N] (one per output channel); `cpu` the C++ kernel's
    packed form, or None (then the reference runs)."""

    weight: torch.Tensor
    scale: torch.Tensor
    cpu: PackedQuant | None = None
    onednn_rows: int | None = None  # packed, and from this many rows on oneDNN's int8 matmul instead
    onednn: QC.OneDnnInt8 | None = None  # where the CPU has AMX: `weight` prepacked by oneDNN (then `weight` None)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (int8 [M, K], float32 scale [M, 1]): symmetric per-row quantization with compressed-tensors'
    scale, absmax / 127.5 (half the int8 range [-128, 127]; vLLM's kernels divide by 127), clamped to the range."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 127.5  # [M, 1]
    return torch.round(xf / scale).clamp(-128, 127).to(torch.int8), scale


def prepare_int8(weight: torch.Tensor, scale: torch.Tensor, keep_canonical: bool = True) -> Int8Weights:
    """Canonical int8 [N, K] weight and its per-channel scale ([N] or [N, 1]) -> the kernel's form. Without
    `keep_canonical`, a weight packed for the CPU kernel is held only packed (`weight` None)."""
    weight, scale = weight.to(torch.int8).contiguous(), scale.reshape(-1).float().contiguous()
    w = Int8Weights(weight, scale, QC.pack_int8(weight, scale) if _packs_here(weight) else None)
    if w.cpu is not None and not w.cpu.amx_rows:  # (on our AMX tiles every row count beats oneDNN's)
        w.onednn_rows = onednn_min_rows(torch.int8)  # AMX: oneDNN's int8 matmul wins from some row count on
        if w.onednn_rows is not None:
            w.onednn = QC.prepack_int8_onednn(weight)
    if w.cpu is not None and not keep_canonical and (w.onednn_rows is None or w.onednn is not None):
        w.weight = None
    return w


def int8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Reference W8A8: x [M, K] -> [M, N] in x.dtype (int32 sums of int8 products, rescaled in float32)."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows_int8(x2)
    acc = (xq.to(torch.int64) @ weight.to(torch.int64).t()).float()  # [M, N], exact integer sums
    y = acc * xs * scale.reshape(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def int8_linear_onednn(
    x: torch.Tensor, weight: torch.Tensor | QC.OneDnnInt8, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """W8A8 through oneDNN's int8 matmul (`torch._int_mm`, or the prepacked matrix's `qlinear_pointwise`; AMX
    tiles where the CPU has them): the reference's quantization and epilogue, the same exact int32 sums. x [..., K]
    -> [..., N] in x.dtype."""
    if QC.quant_kernel() is not None and x.dtype in (torch.float32, torch.bfloat16):
        return QC.int8_matmul_onednn(x, weight, scale, bias)  # the same, both ends in C++
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows_int8(x2)  # [M, K] int8, [M, 1]
    y = torch._int_mm(xq, weight.t()).float().mul_(xs).mul_(scale.reshape(1, -1))  # [M, N]; weight [N, K] read
    if bias is not None:  # transposed, in place after
        y.add_(bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def int8_linear(x: torch.Tensor, w: Int8Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 matmul: x [..., K] -> [..., N] in x.dtype."""
    if x.is_cuda:  # the CUDA route goes here; the reference meanwhile
        return int8_linear_ref(x, w.weight, w.scale, bias)
    if w.cpu is not None:
        if onednn_takes(x, w.onednn_rows):
            return int8_linear_onednn(x, w.onednn or w.weight, w.scale, bias)
        return QC.quant_matmul(x, w.cpu, bias)
    return int8_linear_ref(x, w.weight, w.scale, bias)


def int8_linear_silu_mul(
    x: torch.Tensor, w: Int8Weights, bias: torch.Tensor | None, intermediate: int
) -> torch.Tensor | None:
    """W8A8 gate_up ([2I, K], gate rows first) followed by silu(gate) * up: [..., K] -> [..., I] in one pass of the
    AMX int8 kernel, rounded as the unfused ops round; None where the matrix is not in the tile layout or I is not a
    multiple of 32 (the caller runs `int8_linear` and the activation apart)."""
    if (
        w.cpu is None
        or not w.cpu.amx_rows
        or intermediate % QC.PANEL
        or 2 * intermediate != w.cpu.out_features
        or x.dtype not in (torch.float32, torch.bfloat16)
    ):  # (float16 would round through float32 here)
        return None
    return QC.quant_matmul(x, w.cpu, bias, silu_mul=True)


# ----------------------------------------------------------------------------------------------------- WNA16


@dataclass
class WNA16Weights:
    """A weight-only quantized matrix: `q` uint8 [N, K] (values < 2^bits), `scales` float [N, G], `zeros` uint8
    [N, G]; `perm` int64 [K] or None: the input columns in group order (act order), applied to x first; `cpu` the C++
    kernel's packed form, or None (then the reference runs)."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    bits: int
    perm: torch.Tensor | None = None
    cpu: PackedQuant | None = None


def group_index(in_features: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """int64 [K]: the group of every input column (g_idx as given, else k // group_size)."""
    if g_idx is not None:
        return g_idx.to(torch.int64)
    return torch.arange(in_features, dtype=torch.int64) // group_size


def dequantize_wna16_ref(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None
) -> torch.Tensor:
    """Canonical q [N, K], scales [N, G], zeros [N, G] (+ g_idx [K]) -> float32 W [N, K] = (q - z) * s."""
    groups = group_index(q.shape[1], group_size, g_idx).to(q.device)  # [K]
    z = zeros.to(torch.float32)[:, groups]  # [N, K]
    s = scales.to(torch.float32)[:, groups]  # [N, K]
    return (q.to(torch.float32) - z) * s


def wna16_linear_ref(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
    weight_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reference weight-only matmul: x [..., K] -> [..., N] in x.dtype, computed in float32. `weight_dtype` bf16:
    each dequantized weight rounded to bf16 first (what the AMX tile path multiplies, as HF's bf16 models do)."""
    w = dequantize_wna16_ref(q, scales, zeros, group_size, g_idx).to(weight_dtype).float()
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def prepare_wna16(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    g_idx: torch.Tensor | None = None,
    keep_canonical: bool = True,
) -> WNA16Weights:
    """Canonical q / scales / zeros (+ act-order g_idx) -> the kernel's form. With a g_idx that is not k // group
    size the columns are sorted by group (`perm`), so every group is contiguous. Without `keep_canonical`, a matrix
    packed for the CPU kernel is held only packed (`q` None)."""
    if bits not in (4, 8):
        raise ValueError(f"weight-only quantization with {bits} bits is not supported (4 or 8)")
    perm = None
    if g_idx is not None:
        groups = g_idx.to(torch.int64)
        if not torch.equal(groups, torch.arange(q.shape[1], device=q.device) // group_size):
            perm = torch.argsort(groups, stable=True)
            q = q[:, perm]
    w = WNA16Weights(
        q.to(torch.uint8).contiguous(), scales.contiguous(), zeros.to(torch.uint8).contiguous(), group_size, bits, perm
    )
    if _packs_here(q):
        w.cpu = QC.pack_wna16(w.q, w.scales, w.zeros, group_size, bits)
        if not keep_canonical:
            w.q = None
    return w


def wna16_linear(x: torch.Tensor, w: WNA16Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only matmul: x [..., K] -> [..., N] in x.dtype."""
    if x.is_cuda:  # the CUDA route goes here; the reference meanwhile
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        return wna16_linear_ref(x, w.q, w.scales, w.zeros, w.group_size, None, bias)
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    if w.cpu is not None:
        return QC.quant_matmul(x, w.cpu, bias)
    return wna16_linear_ref(x, w.q, w.scales, w.zeros, w.group_size, None, bias)


# ----------------------------------------------------------------------------------------------------- FP8


@dataclass
class FP8Weights:
    """An FP8 matrix: `weight` float8_e4m3fn [N, K]; `scale` float32 [] (tensor), [N] (channel) or [N/bn, K/bk]
    (`block` = (bn, bk)). Activations: `act` "token" / "group" (dynamic, `act_group` columns a group) or "static"
    (`input_scale`, one per tensor). `cpu`: the C++ kernel's packed form, or None (then the reference runs)."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None
    act: str
    act_group: int = 0
    input_scale: torch.Tensor | None = None
    cpu: PackedQuant | None = None


def quantize_fp8_ref(
    x: torch.Tensor, act: str, act_group: int = 0, input_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float -> float32 [M, K]: x rounded through float8_e4m3fn with a dynamic per-token / per-group or a
    static scale, then scaled back (the values an FP8 GEMM would multiply)."""
    xf = x.float()
    if act == "static":
        s = input_scale.float().reshape(1, 1)
    elif act == "token":
        s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [M, 1]
    elif act == "group":
        g = xf.reshape(xf.shape[0], -1, act_group)  # [M, K/g, g]
        s = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
        return q.reshape_as(xf)
    else:
        raise ValueError(f"unknown FP8 activation scheme {act!r}")
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s


def dequantize_fp8_ref(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float8 W [N, K] and its scale -> float32 [N, K]."""
    w = weight.float()
    if block is None:
        return w * (scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float())
    bn, bk = block
    s = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]  # [N, K]
    return w * s


def fp8_linear_ref(x: torch.Tensor, w: FP8Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference FP8 matmul: x [..., K] -> [..., N] in x.dtype, computed in float32."""
    x2 = x.reshape(-1, x.shape[-1])
    xq = quantize_fp8_ref(x2, w.act, w.act_group, w.input_scale)
    y = F.linear(xq, dequantize_fp8_ref(w.weight, w.scale, w.block), None if bias is None else bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def prepare_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    act: str,
    act_group: int = 0,
    input_scale: torch.Tensor | None = None,
    keep_canonical: bool = True,
) -> FP8Weights:
    """float8_e4m3fn [N, K] weight, its scale and the activation scheme -> the kernel's form. Without
    `keep_canonical`, a weight packed for the CPU kernel is held only packed (`weight` None)."""
    w = FP8Weights(
        weight.contiguous(),
        scale.float().contiguous(),
        block,
        act,
        act_group,
        None if input_scale is None else input_scale.float(),
    )
    if _packs_here(weight):
        w.cpu = QC.pack_fp8(w.weight, w.scale, block, act, act_group, w.input_scale)
        if not keep_canonical:
            w.weight = None
    return w


def fp8_linear(x: torch.Tensor, w: FP8Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """FP8 matmul: x [..., K] -> [..., N] in x.dtype."""
    if x.is_cuda:  # the CUDA route goes here; the reference meanwhile
        return fp8_linear_ref(x, w, bias)
    if w.cpu is not None:  # x rounded through fp8 as quantize_fp8_ref rounds it, then float32 sums, in C++
        return QC.quant_matmul(x, w.cpu, bias)
    return fp8_linear_ref(x, w, bias)
