"""Triton weight-only GEMM for WNA16 (4- or 8-bit integer weights, 16/32-bit activations): `y = x @ W^T (+ bias)`
with W dequantized tile by tile inside the K loop (`w = (q - z) * s`), accumulated in float32.

Layout (`pack_wna16_for_triton` builds it from the canonical q [N, K] of `quant_linear`):
- `qweight` int32 [ceil(K / P), N], P = 32 / bits values per word, packed along K: word row r of column n holds
  q[n, r * P + i] in bits [i * bits, (i + 1) * bits) (K is padded with zeros to a multiple of P);
- `scales` [G, N] in x.dtype or float32 and `zeros` uint8 [G, N], G = ceil(K / group_size): the group of input
  column k is k // group_size (act order is a permutation of x's columns, applied by the caller).

A program computes one [BLOCK_M, BLOCK_N] tile of y over a K range: it loads a packed [BLOCK_K / P, BLOCK_N] tile
(each word once), unpacks it to [BLOCK_K, BLOCK_N] by shifting and reshaping, loads the scales and zeros of the
groups that tile touches (one row when a group spans the whole tile), dequantizes to x.dtype and calls `tl.dot`.
Decode-sized M (few row tiles, N / BLOCK_N programs) can split K over SPLIT_K programs that write float32 partial
sums, added up by torch afterwards (`_split_k`).

Tiles: `default_config(M)` under the interpreter and when `autotune=False`; on CUDA a small `triton.autotune` list,
pruned by M bucket (decode M <= 32 vs mid vs prefill M >= 128), tuned once per (M bucket, N, K, bits, group size,
split, dtypes) at the first call with that key, so a caller that captures CUDA graphs must call each shape before
capture (tuning launches the kernel several times and synchronizes).

Where this has run: only under Triton's CPU interpreter (tests/kernels/test_triton_wna16.py) and through the sm_90
ahead-of-time compile in that test (lowered to a cubin, never launched). No line of it, autotuning included, has
executed on a GPU yet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def _group_rows(
    ptr,
    k0,
    offs_n,
    n_mask,
    num_groups,
    stride_g,
    GROUP_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # the [BLOCK_K, BLOCK_N] (broadcastable) per-input-column values of a [G, N] table for columns k0 .. k0+BLOCK_K
    if GROUP_SIZE % BLOCK_K == 0:
        # the whole tile lies in one group: one row, broadcast over the tile's K
        g = k0 // GROUP_SIZE
        return tl.load(ptr + g * stride_g + offs_n, mask=n_mask, other=0)[None, :]
    elif (BLOCK_K % GROUP_SIZE == 0) and ((GROUP_SIZE & (GROUP_SIZE - 1)) == 0):
        # BLOCK_K / GROUP_SIZE whole groups: load each row once, repeat it GROUP_SIZE times along K
        NG: tl.constexpr = BLOCK_K // GROUP_SIZE
        g = k0 // GROUP_SIZE + tl.arange(0, NG)
        rows = tl.load(
            ptr + g[:, None] * stride_g + offs_n[None, :], mask=(g < num_groups)[:, None] & n_mask[None, :], other=0
        )  # [NG, BLOCK_N]
        rows = tl.broadcast_to(rows[:, None, :], (NG, GROUP_SIZE, BLOCK_N))
        return tl.reshape(rows, (BLOCK_K, BLOCK_N))
    else:
        # any other group size: gather the group of every column
        g = (k0 + tl.arange(0, BLOCK_K)) // GROUP_SIZE
        return tl.load(
            ptr + g[:, None] * stride_g + offs_n[None, :], mask=(g < num_groups)[:, None] & n_mask[None, :], other=0
        )


@triton.jit(do_not_specialize=["M", "m_bucket"])
def _wna16_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    m_bucket,
    num_groups,
    k_per_split,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_om,
    stride_osplit,
    GROUP_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # x [M, K] (last dim contiguous); qweight int32 [ceil(K/P), N]; scales, zeros [G, N]; out [M, N] or, with
    # SPLIT_K > 1, float32 [SPLIT_K, M, N]. m_bucket only keys the autotuner (M is not specialized on, so one
    # compiled kernel serves every M of a bucket).
    PACK: tl.constexpr = 32 // BITS
    PACKED_K: tl.constexpr = BLOCK_K // PACK
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # grouped order: GROUP_M row tiles share each column tile while it is in L2
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    shifts = tl.arange(0, PACK) * BITS  # [PACK]: bit offset of each value in a word
    packed_rows = (K + PACK - 1) // PACK

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split  # a multiple of BLOCK_K
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        # packed words: [PACKED_K, BLOCK_N] -> values [BLOCK_K, BLOCK_N], k = row * PACK + i
        r = k0 // PACK + tl.arange(0, PACKED_K)
        words = tl.load(
            qw_ptr + r[:, None] * stride_qk + offs_n[None, :],
            mask=(r < packed_rows)[:, None] & n_mask[None, :],
            other=0,
        )
        q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [PACKED_K, PACK, BLOCK_N]
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        s = _group_rows(s_ptr, k0, offs_n, n_mask, num_groups, stride_sg, GROUP_SIZE, BLOCK_K, BLOCK_N)
        z = _group_rows(z_ptr, k0, offs_n, n_mask, num_groups, stride_zg, GROUP_SIZE, BLOCK_K, BLOCK_N)
        w = ((q.to(tl.float32) - z.to(tl.float32)) * s.to(tl.float32)).to(a.dtype)  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            # the interpreter's bf16 dot is wrong: multiply the bf16-rounded values in float32 instead
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        elif FP32_DOT:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)

    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        out = out_ptr + pid_k.to(tl.int64) * stride_osplit + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc, mask=out_mask)


@dataclass(frozen=True)
class WNA16Config:
    """One launch shape of `_wna16_kernel`."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8

    def meta(self) -> dict:
        return dict(
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            BLOCK_K=self.block_k,
            GROUP_M=self.group_m,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


# autotune candidates by M bucket: decode (M <= 32) streams the weight, so wide K tiles, few rows, many programs;
# prefill (M >= 128) is compute-bound, so large square-ish tiles
DECODE_CONFIGS = [
    WNA16Config(16, 64, 128, 4, 4),
    WNA16Config(16, 128, 128, 4, 4),
    WNA16Config(16, 64, 256, 4, 3),
    WNA16Config(32, 64, 128, 4, 4),
]
MID_CONFIGS = [WNA16Config(32, 64, 128, 4, 4), WNA16Config(64, 64, 64, 4, 4), WNA16Config(64, 128, 64, 4, 4)]
PREFILL_CONFIGS = [
    WNA16Config(64, 128, 64, 4, 4),
    WNA16Config(128, 128, 64, 8, 3),
    WNA16Config(128, 256, 64, 8, 3),
    WNA16Config(128, 64, 64, 4, 4),
]
K_SPLIT_ALIGN = 256  # k_per_split is a multiple of every BLOCK_K above


def m_bucket(m: int) -> int:
    """The autotune key for M: the next power of two, at least 16, at most 256."""
    return min(256, max(16, triton.next_power_of_2(m)))


def configs_for(m: int) -> list[WNA16Config]:
    """The autotune candidates for M rows."""
    bucket = m_bucket(m)
    return DECODE_CONFIGS if bucket <= 32 else MID_CONFIGS if bucket < 128 else PREFILL_CONFIGS


def default_config(m: int, interpreted: bool = False) -> WNA16Config:
    """The fixed tile for M rows (no tuning): the first candidate of its bucket, or a small one for the
    interpreter."""
    if interpreted:
        return WNA16Config(16 if m <= 16 else 32, 32, 64, 4, 1, 4)
    return configs_for(m)[0]


def _prune(configs, named_args, **kwargs):
    bucket = named_args["m_bucket"]
    wanted = set(configs_for(bucket))
    return [c for c in configs if c.__dict__.get("_wna16") in wanted]


def _triton_configs() -> list[triton.Config]:
    out = []
    for cfg in dict.fromkeys(DECODE_CONFIGS + MID_CONFIGS + PREFILL_CONFIGS):
        meta = cfg.meta()
        tc = triton.Config(
            {k: meta[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")},
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        tc._wna16 = cfg  # what _prune matches on
        out.append(tc)
    return out


_tuned_kernel = triton.autotune(
    configs=_triton_configs(),
    key=["m_bucket", "N", "K", "GROUP_SIZE", "BITS", "SPLIT_K"],
    prune_configs_by={"early_config_prune": _prune},
)(_wna16_kernel)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_k(m: int, n: int, k: int, device: torch.device) -> int:
    # decode only: when the output tiles (at BLOCK_N = 64) leave most SMs idle, split K, keeping >= 512 columns a split
    if device.type != "cuda" or m > 32:
        return 1
    tiles = triton.cdiv(n, 64)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(sms, tiles), k // 512, 8))


def pack_wna16_for_triton(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonical q uint8 [N, K] (values < 2^bits), scales [N, G], zeros uint8 [N, G] -> the kernel's qweight int32
    [ceil(K * bits / 32), N], scales [G, N] (dtype kept) and zeros uint8 [G, N]."""
    if bits not in (4, 8):
        raise ValueError(f"the Triton WNA16 kernel takes 4- or 8-bit weights, not {bits}")
    pack = 32 // bits
    n, k = q.shape
    if q.numel() and int(q.max()) >= (1 << bits):
        raise ValueError(f"q holds values >= 2^{bits}")
    qt = q.to(torch.int64).t()  # [K, N]
    pad = (-k) % pack
    if pad:
        qt = torch.cat([qt, qt.new_zeros(pad, n)])
    qt = qt.reshape(-1, pack, n)  # [K/P, P, N]
    shifts = (torch.arange(pack, device=q.device, dtype=torch.int64) * bits).reshape(1, pack, 1)
    words = (qt << shifts).sum(dim=1)  # [K/P, N], in [0, 2^32): the bit fields do not overlap
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # same bits, as int32
    return words.contiguous(), scales.t().contiguous(), zeros.to(torch.uint8).t().contiguous()


def wna16_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    bias: torch.Tensor | None = None,
    *,
    config: WNA16Config | None = None,
    split_k: int | None = None,
    autotune: bool = True,
) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x [..., K] and the packed W of `pack_wna16_for_triton`: [..., N] in x.dtype.
    `config` / `split_k` fix the launch (else tuned on CUDA, `default_config` elsewhere)."""
    k = x.shape[-1]
    n = qweight.shape[1]
    group_size = group_size if group_size > 0 else k  # -1: one group per output channel
    pack = 32 // bits
    num_groups = triton.cdiv(k, group_size)
    assert bits in (4, 8) and qweight.dtype == torch.int32 and qweight.shape[0] == triton.cdiv(k, pack)
    assert scales.shape == (num_groups, n) and zeros.shape == (num_groups, n) and zeros.dtype == torch.uint8
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0 or n == 0:
        return x.new_zeros(*x.shape[:-1], n)
    interpreted = x.device.type != "cuda"
    split = split_k if split_k is not None else _split_k(m, n, k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), K_SPLIT_ALIGN) * K_SPLIT_ALIGN
    split = triton.cdiv(k, k_per_split)
    # out [M, N] in x.dtype, or float32 partial sums [SPLIT_K, M, N]
    out = x2.new_empty(m, n) if split == 1 else x2.new_empty(split, m, n, dtype=torch.float32)
    has_bias = bias is not None and split == 1
    args = (
        x2,
        qweight,
        scales,
        zeros,
        bias if has_bias else x2,
        out,
        m,
        n,
        k,
        m_bucket(m),
        num_groups,
        k_per_split,
        x2.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        out.stride(-2),
        out.stride(0) if split > 1 else 0,
    )
    flags = dict(
        GROUP_SIZE=group_size,
        BITS=bits,
        HAS_BIAS=has_bias,
        SPLIT_K=split,
        UPCAST=interpreted and x.dtype == torch.bfloat16,
        FP32_DOT=x.dtype == torch.float32,
    )

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), split)

    if config is None and autotune and not interpreted:
        _tuned_kernel[grid](*args, **flags)
    else:
        cfg = config or default_config(m, interpreted)
        assert min(cfg.block_m, cfg.block_n, cfg.block_k) >= MIN_DOT and K_SPLIT_ALIGN % cfg.block_k == 0
        _wna16_kernel[grid](*args, **flags, **cfg.meta())
    if split > 1:
        y = out.sum(dim=0)  # [M, N] float32
        if bias is not None:
            y += bias.float()
        out = y.to(x.dtype)
    return out.reshape(*x.shape[:-1], n)
