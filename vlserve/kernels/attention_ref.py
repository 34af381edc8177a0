"""Torch paged attention: the production CPU path and the reference for the Triton kernels.

On CPU, `attention_forward_ref` hands the step's K/V write and its decode sequences to one C++ call of
`cpu_decode` when it is built (float32/bf16, caches of that dtype or FP8; $VLSERVE_CPU_DECODE_KERNEL=0 turns it
off); the torch write and decode below are the reference it is tested against and the fallback.

Decode gathers whole KV blocks through the block tables with one `index_select` per chunk of
sequences into a reusable workspace, and runs the fused CPU SDPA kernel (float32 softmax) on
strided views of it. GQA is folded into the query: the Hq/Hkv query heads that share a KV head
become Hq/Hkv query rows of that head, so K/V are never repeated. Sequences are taken longest
first and each chunk is padded only to its own longest context. Chunking bounds the workspace and
keeps the gathered K/V cache-resident while SDPA reads it (measured 2-3x faster than one
whole-batch gather at B=64, ctx=1024). Padded key positions are zeroed in the workspace and masked,
so garbage (even NaN) in unwritten cache slots never reaches the output.

Prefill: a layer without sliding window sends a step's causal sequences (two or more) through `prefill_batch`, a
few padded SDPA calls; the others loop: gather one context, then SDPA with an `is_causal` or bottom-right-aligned
causal mask (queries are the last q_len of seq_len positions).

Sliding-window layers (`sliding_window` W, HF's convention): the query at position p sees keys p - W + 1 .. p only.
Decode masks the keys below each sequence's window; prefill gathers from the block holding its first query's window
start and masks per query row.

Key limits (`md.key_limits`, see `key_limits`): a prefill sequence with a token that may attend past its own position
is masked per query row by its limits (the window still counts back from the row's own position); the C++ call then
attends the decodes only and every prefill chunk runs here.

FP8 caches (`kv_quant`): the write stores `quantize_kv(x, scale)`; the gathered K/V are dequantized (times
k_scale / v_scale in float32, then in the query's dtype) before SDPA. Other caches ignore the scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlserve.kernels.cpu_decode import (
    MAX_KERNEL_QUERY_LEN,
    attend_rows,
    attention_step_supported,
    kernel_rows,
    step_rows,
)
from vlserve.kernels.key_limits import bidirectional_prefills, key_limit_mask
from vlserve.kernels.kv_quant import dequantize_kv, is_fp8, kv_bytes
from vlserve.kernels.kv_write_ref import valid_slots, write_kv_slots
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.kernels.onednn_linear import empty_rows
from vlserve.kernels.prefill_batch import (
    PrefillGroup,
    batchable_prefills,
    plan_prefill_groups,
    prefill_groups,
    step_prefill_groups,
)
from vlserve.kernels.varlen_attention_cpu import paged_kernel_takes, paged_segment_limits, paged_segments_cpu

# Gathered K+V bytes per decode chunk: small enough that SDPA reads what the gather just wrote
# from cache (measured best at 4-8 MiB on a 2-core Xeon), large enough to keep per-chunk overhead low.
DECODE_CHUNK_BYTES = 8 << 20


def decode_workspace_numel(
    max_seq_len: int, block_size: int, num_kv_heads: int, head_dim: int, element_size: int
) -> int:
    """Elements of the flat scratch buffer `paged_attention_decode_ref` gathers K and V into: enough for any step
    whose sequences are at most max_seq_len long (DECODE_CHUNK_BYTES worth, or one whole longest sequence when that
    is larger). The model runner allocates it once and passes it as `workspace`."""
    padded = -(-max_seq_len // block_size) * block_size
    return max(DECODE_CHUNK_BYTES // element_size, 2 * padded * num_kv_heads * head_dim)


@dataclass
class DecodeChunk:
    """One batch of decode sequences that share a K/V gather and one SDPA call (see `plan_decode`)."""

    rows: slice | torch.Tensor  # the chunk's sequences among the step's decodes
    num_blocks: int  # blocks gathered per sequence: the chunk's longest context, block aligned
    context_len: int  # keys SDPA reads per sequence: the common length, or num_blocks * block_size with `mask`
    block_ids: torch.Tensor  # [n * num_blocks] int64: cache blocks to gather, row-major by sequence
    pad_rows: torch.Tensor | None  # [P] int64: gathered positions past their sequence's end, zeroed before SDPA
    mask: torch.Tensor | None  # [n, 1, 1, context_len] bool: True where a key is inside its sequence

    @property
    def num_seqs(self) -> int:
        return self.block_ids.shape[0] // self.num_blocks


def plan_decode(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, lens: list[int], block_size: int, token_bytes: int
) -> list[DecodeChunk]:
    """Split a step's decode sequences into gather chunks of about DECODE_CHUNK_BYTES of K+V (`token_bytes`: K+V of
    one position), longest first. Everything here depends only on the step, not the layer, so the runner's
    attention computes it once per step (`AttentionMetadata.derived`) and every layer reuses it."""
    # block_tables: [B, M] int32; seq_lens: [B] int32; lens: the same B lengths as ints
    num_seqs = len(lens)
    device = block_tables.device
    order = sorted(range(num_seqs), key=lambda i: -lens[i])
    in_order = order == list(range(num_seqs))
    tables = block_tables.to(torch.long).clamp_min(0)  # [B, M] (a copy: the step's table stays as it is)
    chunks = []
    start = 0
    while start < num_seqs:
        longest = lens[order[start]]
        num_blocks = max(1, -(-longest // block_size))
        padded_len = num_blocks * block_size
        n = max(1, min(num_seqs - start, DECODE_CHUNK_BYTES // (padded_len * token_bytes)))
        end = start + n
        if in_order:
            rows: slice | torch.Tensor = slice(start, end)
        else:
            rows = torch.tensor(order[start:end], dtype=torch.long, device=device)
        block_ids = tables[rows, :num_blocks].reshape(-1)  # [n * nblk]
        shortest = lens[order[end - 1]]
        if shortest == longest:  # one length: SDPA reads exactly it, nothing to mask or zero
            chunks.append(DecodeChunk(rows, num_blocks, longest, block_ids, None, None))
        else:
            chunk_lens = seq_lens[rows].to(device=device, dtype=torch.long)  # [n]
            valid = torch.arange(padded_len, device=device) < chunk_lens[:, None]  # [n, L]
            pad_rows = (~valid).view(-1).nonzero().squeeze(1)  # indices into the n*L gathered positions
            chunks.append(DecodeChunk(rows, num_blocks, padded_len, block_ids, pad_rows, valid[:, None, None, :]))
        start = end
    return chunks


def paged_attention_decode_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    plan: list[DecodeChunk] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence (at position seq_len-1) attending to its seq_len cached keys (its last
    `sliding_window` keys when given). K/V are gathered into `workspace` (flat, the cache's dtype; see
    decode_workspace_numel) when it is given and large enough, else into a buffer of this call's own. `plan`: this
    step's `plan_decode` (built here when not given). FP8 caches: the gathered K/V are dequantized with k_scale /
    v_scale."""
    # query: [B, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [B, M] int32; seq_lens: [B]
    del max_seq_len  # chunks are padded to their own longest sequence, read from seq_lens
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if out is None:
        out = query.new_empty(num_seqs, num_q_heads, head_dim)
    if num_seqs == 0:
        return out
    if plan is None:
        token_bytes = 2 * num_kv_heads * head_dim * k_cache.element_size()
        plan = plan_decode(block_tables, seq_lens, seq_lens.tolist(), block_size, token_bytes)
    fp8 = is_fp8(k_cache)
    q4 = query.reshape(num_seqs, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    out4 = out.view(num_seqs, num_kv_heads, group, head_dim)
    for chunk in plan:
        n, padded_len = chunk.num_seqs, chunk.num_blocks * block_size
        numel = 2 * n * padded_len * num_kv_heads * head_dim
        if workspace is not None and workspace.numel() >= numel and workspace.dtype == k_cache.dtype:
            ws = workspace[:numel]
        else:
            ws = torch.empty(numel, dtype=k_cache.dtype, device=k_cache.device)
        ws_k, ws_v = ws.view(2, n * chunk.num_blocks, block_size, num_kv_heads, head_dim).unbind(0)
        torch.index_select(k_cache, 0, chunk.block_ids, out=ws_k)  # [n*nblk, BS, Hkv, D]
        torch.index_select(v_cache, 0, chunk.block_ids, out=ws_v)
        if chunk.pad_rows is not None:
            # zero the (few) padded positions: stale or never-written slots may hold NaN/inf, and NaN * 0 or
            # NaN - inf would leak through the mask (FP8: through a byte view; byte 0 is +0.0)
            fill_k, fill_v = (kv_bytes(ws_k), kv_bytes(ws_v)) if fp8 else (ws_k, ws_v)
            fill_k.view(n * padded_len, -1).index_fill_(0, chunk.pad_rows, 0)
            fill_v.view(n * padded_len, -1).index_fill_(0, chunk.pad_rows, 0)
        L = chunk.context_len
        k = ws_k.view(n, padded_len, num_kv_heads, head_dim)[:, :L].transpose(1, 2)  # [n, Hkv, L, D] (strided)
        v = ws_v.view(n, padded_len, num_kv_heads, head_dim)[:, :L].transpose(1, 2)
        if fp8:
            k, v = dequantize_kv(k, k_scale, query.dtype), dequantize_kv(v, v_scale, query.dtype)
        mask = chunk.mask
        if sliding_window is not None:  # keys below each sequence's window: masked too
            lens = seq_lens[chunk.rows].to(device=query.device, dtype=torch.long)  # [n]
            window = torch.arange(L, device=query.device) >= (lens - sliding_window)[:, None]  # [n, L]
            mask = window[:, None, None, :] if mask is None else mask & window[:, None, None, :]
        out4[chunk.rows] = F.scaled_dot_product_attention(q4[chunk.rows], k, v, attn_mask=mask, scale=scale)
    return out


def _gather_context(
    cache: torch.Tensor, table: torch.Tensor, seq_len: int, scale: float, dtype: torch.dtype, first_block: int = 0
) -> torch.Tensor:
    # cache: [NB, BS, Hkv, D]; table: [M] -> [Hkv, S, D] contiguous (SDPA is faster on it), in `dtype`: positions
    # first_block * BS .. seq_len - 1, S of them (FP8 caches: dequantized with `scale`)
    _, block_size, num_kv_heads, head_dim = cache.shape
    num_blocks = -(-seq_len // block_size) - first_block
    blocks = cache.index_select(0, table[first_block : first_block + num_blocks].to(torch.long))  # [nblk, BS, Hkv, D]
    context = blocks.view(num_blocks * block_size, num_kv_heads, head_dim)[: seq_len - first_block * block_size]
    context = context.transpose(0, 1)
    return dequantize_kv(context.contiguous(), scale, dtype) if is_fp8(cache) else context.contiguous()


def _prefill_from_lists(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    key_limits: torch.Tensor | None = None,
    bidirectional: tuple[bool, ...] = (),
    batch: bool = True,
    groups: list[PrefillGroup] | None = None,
) -> torch.Tensor:
    # query, out: [T, Hq, D]; query_start_loc: B+1 ints; seq_lens: B ints; key_limits: [T] int64 (read for sequence b
    # when bidirectional[b]: see `key_limits.bidirectional_prefills`; the other sequences stay causal). `batch`: the
    # causal sequences of a layer without sliding window go through `prefill_batch` (`groups`: its plan, when made)
    num_q_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1:3]
    batched = batchable_prefills(query_start_loc, seq_lens, bidirectional) if batch and sliding_window is None else []
    if batched:
        if groups is None:
            groups = plan_prefill_groups(block_tables, query_start_loc, seq_lens, batched, block_size)
        prefill_groups(query, k_cache, v_cache, groups, scale, out, k_scale, v_scale)
    batched = set(batched)
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = query_start_loc[b], query_start_loc[b + 1]
        q_len = q_end - q_start
        if q_len == 0 or b in batched:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {b}: q_len {q_len} > seq_len {seq_len}")
        q = query[q_start:q_end].transpose(0, 1).contiguous().unsqueeze(0)  # [1, Hq, q_len, D]
        # sliding window: the blocks wholly below the first query's window are not gathered
        first = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1) // block_size
        k = _gather_context(k_cache, block_tables[b], seq_len, k_scale, query.dtype, first).unsqueeze(0)  # [1,Hkv,S,D]
        v = _gather_context(v_cache, block_tables[b], seq_len, v_scale, query.dtype, first).unsqueeze(0)
        if bidirectional and bidirectional[b]:
            mask = key_limit_mask(
                key_limits[q_start:q_end], seq_len - q_len, first * block_size, seq_len, sliding_window
            )  # [q_len, S]
        elif sliding_window is not None:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [q_len]
            k_pos = torch.arange(first * block_size, seq_len, device=query.device)  # [S]
            mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        elif q_len == seq_len:
            mask = None  # SDPA's own causal mask
        else:
            # query i sits at position seq_len - q_len + i and sees keys 0..that position
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [q_len]
            k_pos = torch.arange(seq_len, device=query.device)  # [S]
            mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, S]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=num_q_heads != num_kv_heads
        )
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


def paged_prefill_attention_ref(
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of each sequence's new tokens over its cached prefix plus themselves (the last
    `sliding_window` positions up to each query's, when given; FP8 caches: dequantized with k_scale / v_scale)."""
    # query: [T, Hq, D]; block_tables: [B, M] int32; query_start_loc: [B+1] int32; seq_lens: [B] int32
    del max_query_len  # only the Triton grid needs it
    if out is None:
        out = torch.zeros_like(query)
    return _prefill_from_lists(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc.tolist(),
        seq_lens.tolist(),
        scale,
        out,
        k_scale,
        v_scale,
        sliding_window,
    )


def _decode_with_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    k_scale: float,
    v_scale: float,
    sliding_window: int | None,
) -> None:
    """The step's decode rows through the gather + SDPA path, its plan made once per step for all layers."""
    num_decodes = md.num_decodes
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    token_bytes = 2 * num_kv_heads * head_dim * k_cache.element_size()
    plan = md.derive(
        ("decode_plan", block_size, token_bytes),
        lambda: plan_decode(
            md.block_tables[:num_decodes],
            md.seq_lens[:num_decodes],
            md.seq_lens_cpu[:num_decodes],
            block_size,
            token_bytes,
        ),
    )
    paged_attention_decode_ref(
        query[:num_decodes],
        k_cache,
        v_cache,
        md.block_tables[:num_decodes],
        md.seq_lens[:num_decodes],
        scale,
        out=out[:num_decodes],
        workspace=md.workspace,
        plan=plan,
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=sliding_window,
    )


def prefill_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> None:
    """The step's prefill sequences (md.num_decodes ..) through the torch path into `out`, with md.key_limits when
    set (also the Triton path's fallback for a step with bidirectional tokens); the K/V are already written."""
    # query, out: [T, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]
    num_decodes = md.num_decodes
    groups = None if sliding_window is not None else step_prefill_groups(md, k_cache.shape[1])
    _prefill_from_lists(
        query,
        k_cache,
        v_cache,
        md.block_tables[num_decodes:],
        md.query_start_loc_cpu[num_decodes:],
        md.seq_lens_cpu[num_decodes:],
        scale,
        out,
        k_scale,
        v_scale,
        sliding_window,
        md.key_limits,
        bidirectional_prefills(md),
        groups=groups,
    )


def _cpu_step_rows(md: AttentionMetadata, decodes_only: bool):
    """The rows the step's C++ calls attend (the decodes, and short prefill chunks' tokens unless a prefill token
    attends past its own position or `decodes_only`), converted once a step."""
    causal = not bidirectional_prefills(md)
    num_rows, row_seqs, row_lens = kernel_rows(
        md.query_start_loc_cpu,
        md.seq_lens_cpu,
        md.num_decodes,
        MAX_KERNEL_QUERY_LEN if causal and not decodes_only else 0,
    )
    return step_rows(
        md.slot_mapping, md.block_tables, md.seq_lens if row_lens is None else row_lens, num_rows, row_seqs
    )


def _short_prefill_plan(
    md: AttentionMetadata, max_query_len: int, max_context: int
) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """(sequences, first query rows, query lengths, context lengths) of the step's prefill chunks when the paged
    segment kernel takes them all: one longer than MAX_KERNEL_QUERY_LEN (else they are rows of the decode call),
    none longer than `max_query_len` nor over a context of `max_context`, none attending past its own position;
    None otherwise (they go to `prefill_ref`)."""
    first = md.num_decodes
    starts, lens = md.query_start_loc_cpu, md.seq_lens_cpu
    if md.key_limits is not None or first == len(lens):
        return None
    seqs, rows, q_lens, seq_lens = [], [], [], []
    for b in range(first, len(lens)):
        q_len = starts[b + 1] - starts[b]
        if q_len > max_query_len or lens[b] > max_context or q_len > lens[b]:
            return None
        if q_len:
            seqs.append(b)
            rows.append(starts[b])
            q_lens.append(q_len)
            seq_lens.append(lens[b])
    return (seqs, rows, q_lens, seq_lens) if q_lens and max(q_lens) > MAX_KERNEL_QUERY_LEN else None


def attention_forward_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then decode the first md.num_decodes sequences and prefill the rest
    (FP8 caches: written and read with k_scale / v_scale; `sliding_window` W: each query sees its last W positions;
    md.key_limits: see `key_limits`)."""
    # query: [T, Hq, D]; key, value: [T, Hkv, D]; returns [T, Hq, D]
    out = empty_rows(*query.shape, dtype=query.dtype, device=query.device)  # room for o_proj's padded rows
    num_decodes = md.num_decodes
    num_actual = md.query_start_loc_cpu[-1]
    if num_actual < query.shape[0]:
        out[num_actual:].zero_()  # padding rows
    kernel_seqs = num_decodes  # sequences whose rows the C++ call attends
    # a step whose prefill chunks are short (tens to a couple of hundred tokens) attends them in one C++ call over
    # their cached context, after the KV write
    limits = paged_segment_limits(query.dtype, query.shape[-1])
    short = (
        None
        if sliding_window is not None
        else md.derive(("short_prefill_plan", limits), lambda: _short_prefill_plan(md, *limits))
    )
    if short is not None and (is_fp8(k_cache) or not paged_kernel_takes(query, k_cache, v_cache, out)):
        short = None
    # the runner allocates every layer's caches alike: one check per step and dtypes (a draft's cache may differ)
    if md.derive(
        ("cpu_attention_step", query.dtype, key.dtype, k_cache.dtype),
        lambda: attention_step_supported(query, key, k_cache, v_cache),
    ):
        # one C++ call writes every row's K/V and attends the decode rows, and the prefill chunks' rows too when
        # they are short (a handful of tokens each: chunked prefill, speculative verification)
        decodes_only = short is not None
        rows = md.derive(("cpu_step_rows", decodes_only), lambda: _cpu_step_rows(md, decodes_only))
        attend_rows(query, key, value, k_cache, v_cache, rows, scale, out, k_scale, v_scale, sliding_window)
        if rows.seqs.shape[0]:  # the prefill chunks' rows were in the call too
            kernel_seqs = md.num_seqs
    else:
        write_kv_slots(
            key,
            value,
            k_cache,
            v_cache,
            md.derive("kv_write_slots", lambda: valid_slots(md.slot_mapping)),
            k_scale,
            v_scale,
        )
        if num_decodes > 0:
            _decode_with_torch(query, k_cache, v_cache, md, scale, out, k_scale, v_scale, sliding_window)
    if short is not None:
        paged_segments_cpu(query, k_cache, v_cache, md.block_tables, *short, scale, out)
    elif kernel_seqs < md.num_seqs:
        prefill_ref(query, k_cache, v_cache, md, scale, out, k_scale, v_scale, sliding_window)
    return out
