"""Triton varlen causal prefill over the paged cache: each sequence's new tokens attend to its cached prefix and
to themselves.

One program takes BLOCK_M query tokens of one sequence times the GROUP query heads that share a KV head (so each
K/V tile is loaded once per group) and runs an online softmax over key tiles of BLOCK_N. Key tiles below the
program's first query position are visible to all its rows: they run without the causal mask and without bounds
masks (flash attention's split); only the tiles on the diagonal are masked.

Sliding window W (HF's convention: the query at p sees keys p - W + 1 .. p): tiles wholly below the program's first
row's window are skipped; those that reach below its last row's window start are masked as the diagonal's are,
and a row whose keys are all masked in a tile leaves its running max at -inf without a NaN.

FP8 caches: tiles are dequantized as they are loaded (`triton_paged.load_kv_tile`), then cast to the query's dtype.

Tile shapes come from `prefill_tile`: 128-row tiles of 64 keys for 16-bit inputs on CUDA (warps and pipeline
stages by head dim and GPU generation), the small tile everywhere else. `benchmarks/prefill_attention.py --sweep`
times the candidates on a GPU against flash SDPA.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from vlserve.kernels.kv_quant import is_fp8
from vlserve.kernels.triton_paged import LOG2E, MIN_DOT, check_cache, load_kv_tile, upcast_dots

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillTile:
    """One launch shape: `rows` = query tokens x GROUP_P2 heads per program, `block_n` keys per step."""

    rows: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3


SMALL_TILE = PrefillTile()  # the interpreter's and fp32's: the shape before per-GPU tiles, Triton's default warps
MIN_TILE = PrefillTile(num_stages=1)  # the fallback where a GPU lacks the shared memory for a tile


def prefill_tile(head_dim: int, dtype: torch.dtype, device: torch.device) -> PrefillTile:
    """The launch shape for this head dim, dtype and device (see the module docstring)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return SMALL_TILE
    head_dim_p2 = triton.next_power_of_2(head_dim)
    hopper = torch.cuda.get_device_capability(device)[0] >= 9
    if head_dim_p2 <= 64:
        return PrefillTile(rows=128, block_n=64, num_warps=4, num_stages=3)
    if head_dim_p2 <= 128:
        return PrefillTile(rows=128, block_n=64, num_warps=8, num_stages=3 if hopper else 2)
    return PrefillTile(rows=64, block_n=32, num_warps=8, num_stages=2)


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    n0,
    end,
    k_cache_ptr,
    v_cache_ptr,
    bt_row_ptr,
    kv_head,
    d,
    d_mask,
    stride_cb,
    stride_cs,
    stride_ch,
    scale_log2,
    k_scale,
    v_scale,
    window,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    MASK_D: tl.constexpr,
    DIAGONAL: tl.constexpr,
    FP8: tl.constexpr,
    SLIDING: tl.constexpr,
):
    # one online-softmax step over keys [n0, n0 + BLOCK_N); DIAGONAL: apply the causal and the length masks (and,
    # SLIDING, the window's lower bound: key n is visible to the row at q_pos when n > q_pos - window)
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < end
    k = load_kv_tile(
        k_cache_ptr,
        bt_row_ptr,
        n,
        n_mask,
        kv_head,
        d,
        d_mask,
        stride_cb,
        stride_cs,
        stride_ch,
        k_scale,
        BLOCK_SIZE,
        UPCAST,
        DIAGONAL,
        MASK_D,
        FP8,
    )  # [BLOCK_N, HEAD_DIM_P2]
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale_log2  # [ROWS, BLOCK_N]
    if DIAGONAL:
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if SLIDING:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite without a window: key 0 is in the first tile, seen by every row
    if SLIDING and DIAGONAL:  # a row may have seen no key yet: keep exp2 away from -inf - -inf
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_kv_tile(
        v_cache_ptr,
        bt_row_ptr,
        n,
        n_mask,
        kv_head,
        d,
        d_mask,
        stride_cb,
        stride_cs,
        stride_ch,
        v_scale,
        BLOCK_SIZE,
        UPCAST,
        DIAGONAL,
        MASK_D,
        FP8,
    ).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    qsl_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_ot,
    stride_oh,
    k_scale,
    v_scale,
    window,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8: tl.constexpr,
    SLIDING: tl.constexpr,
):
    # grid: (cdiv(max_q_len, BLOCK_M), B, Hkv); rows = BLOCK_M query tokens x GROUP_P2 heads of one group
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        ctx_start = seq_len - q_len  # position of the sequence's first query token
        r = tl.arange(0, BLOCK_M * GROUP_P2)
        tok = m0 + r // GROUP_P2
        g = r % GROUP_P2
        row_mask = (tok < q_len) & (g < GROUP)
        q_pos = ctx_start + tok  # [ROWS]; padded rows sit past seq_len, so they never see an empty row
        d = tl.arange(0, HEAD_DIM_P2)
        d_mask = d < HEAD_DIM
        q_off = (q_start + tok).to(tl.int64) * stride_qt + (kv_head * GROUP + g) * stride_qh
        q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb

        m_i = tl.full([BLOCK_M * GROUP_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_P2], tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_P2, HEAD_DIM_P2], tl.float32)
        end = tl.minimum(seq_len, ctx_start + m0 + BLOCK_M)  # last key any row of this tile needs, +1
        # keys [0, below) lie at or before the first row's position (< seq_len): no mask for those tiles
        below = (ctx_start + m0 + 1) // BLOCK_N * BLOCK_N
        mid = 0  # tiles [mid, below) run unmasked
        if SLIDING:
            # tiles below the first row's window start are skipped; those below `full` (where the last row's window
            # starts, rounded up to a tile) are masked
            start_n = tl.maximum(ctx_start + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
            full = (tl.maximum(end - window, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
            mid = tl.maximum(tl.minimum(full, below), start_n)
            for n0 in range(start_n, mid, BLOCK_N):
                acc, m_i, l_i = _attend_tile(
                    acc,
                    m_i,
                    l_i,
                    q,
                    q_pos,
                    n0,
                    end,
                    k_cache_ptr,
                    v_cache_ptr,
                    bt_row_ptr,
                    kv_head,
                    d,
                    d_mask,
                    stride_cb,
                    stride_cs,
                    stride_ch,
                    scale_log2,
                    k_scale,
                    v_scale,
                    window,
                    BLOCK_SIZE,
                    BLOCK_N,
                    UPCAST,
                    HEAD_DIM != HEAD_DIM_P2,
                    True,
                    FP8,
                    SLIDING,
                )
        for n0 in range(mid, below, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                n0,
                end,
                k_cache_ptr,
                v_cache_ptr,
                bt_row_ptr,
                kv_head,
                d,
                d_mask,
                stride_cb,
                stride_cs,
                stride_ch,
                scale_log2,
                k_scale,
                v_scale,
                window,
                BLOCK_SIZE,
                BLOCK_N,
                UPCAST,
                HEAD_DIM != HEAD_DIM_P2,
                False,
                FP8,
                SLIDING,
            )
        for n0 in range(below, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                n0,
                end,
                k_cache_ptr,
                v_cache_ptr,
                bt_row_ptr,
                kv_head,
                d,
                d_mask,
                stride_cb,
                stride_cs,
                stride_ch,
                scale_log2,
                k_scale,
                v_scale,
                window,
                BLOCK_SIZE,
                BLOCK_N,
                UPCAST,
                HEAD_DIM != HEAD_DIM_P2,
                True,
                FP8,
                SLIDING,
            )
        if SLIDING:  # a padded row (past seq_len) may see no key in its window: keep its (unstored) row finite
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_i[:, None]
        o_off = (q_start + tok).to(tl.int64) * stride_ot + (kv_head * GROUP + g) * stride_oh
        tl.store(
            out_ptr + o_off[:, None] + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


_fallen_back: set[tuple] = set()  # (device, head dim, dtype, tile) launches that ran out of shared memory


def paged_prefill_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    tile: PrefillTile | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of each sequence's new tokens over its cached prefix plus themselves. `tile`
    overrides `prefill_tile`'s launch shape (benchmark sweeps) and then runs as given: only the chosen shape falls
    back to MIN_TILE where the GPU lacks its shared memory. FP8 caches: dequantized with k_scale / v_scale.
    `sliding_window` W: each query sees only the last W positions up to its own."""
    # query: [T, Hq, D]; block_tables: [B, M] int32; query_start_loc: [B+1] int32; seq_lens: [B] int32
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.zeros_like(query)
    if num_seqs == 0 or num_tokens == 0:
        return out
    check_cache(k_cache, v_cache)
    assert query.stride(-1) == 1 and out.stride(-1) == 1 and block_tables.stride(-1) == 1
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 0:
        return out
    chosen = tile is None
    tile = tile or prefill_tile(head_dim, query.dtype, query.device)
    key = (str(query.device), head_dim, query.dtype, tile)
    if chosen and key in _fallen_back:
        tile = MIN_TILE
    group_p2 = triton.next_power_of_2(group)

    def launch(t: PrefillTile) -> None:
        # query tokens per program: the tile's rows over the group, no more than the longest chunk needs
        bm = min(max(1, t.rows // group_p2), max(triton.next_power_of_2(max_query_len), MIN_DOT // group_p2, 1))
        _prefill_kernel[(triton.cdiv(max_query_len, bm), num_seqs, num_kv_heads)](
            query,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            out,
            scale * LOG2E,
            query.stride(0),
            query.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            float(k_scale),
            float(v_scale),
            int(sliding_window or 0),
            BLOCK_SIZE=block_size,
            GROUP=group,
            GROUP_P2=group_p2,
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=triton.next_power_of_2(head_dim),
            BLOCK_M=bm,
            BLOCK_N=t.block_n,
            UPCAST=upcast_dots(query),
            FP8=is_fp8(k_cache),
            SLIDING=sliding_window is not None,
            num_warps=t.num_warps,
            num_stages=t.num_stages,
        )

    try:
        launch(tile)
    except OutOfResources as exc:  # a GPU with less shared memory than the tile wants
        if not chosen or tile == MIN_TILE:
            raise
        logger.warning("prefill tile %s does not fit this GPU (%s); using %s", tile, exc, MIN_TILE)
        _fallen_back.add(key)
        launch(MIN_TILE)
    return out
