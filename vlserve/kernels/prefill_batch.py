"""Batched causal prefill for the torch path: many short prefill sequences in a few padded SDPA calls.

`plan_prefill_groups` sorts a step's causal prefill sequences by context length (longest first; fresh prompts apart
from those with a cached prefix) and cuts them into groups whose padded area (sequences x longest query x longest context) stays within PAD_AREA_LIMIT of the real
area, with at most MAX_GROUP_SEQS sequences, MAX_GROUP_SCORES padded query-key pairs and MAX_GROUP_KEYS gathered
key positions per group. Large sequences (over MAX_SEQ_SCORES pairs) stay on the per-sequence path.
`prefill_groups` then runs each group as one gather of all its cache blocks, one padded query, one boolean
bottom-right causal mask (none in a group of fresh prompts: SDPA's own causal mask) and one SDPA call, and scatters
the real query rows back.

Gathered key positions past a sequence's length (the rest of its last block, block-table padding) may hold
never-written memory (NaN/inf): they are zeroed before SDPA, since a masked NaN still poisons the output. Padded
query rows (i >= q_len) see every key of their sequence (and, in a fresh group, zeroed ones past it), so no row is
fully masked, and they are dropped before the scatter. The plan depends only on the step, so the runner's attention builds it once for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlserve.kernels.key_limits import bidirectional_prefills
from vlserve.kernels.kv_quant import dequantize_kv, is_fp8
from vlserve.kernels.metadata import AttentionMetadata

PAD_AREA_LIMIT = 1.25  # padded query-key area of a group over its real area
MAX_GROUP_SEQS = 64
MAX_GROUP_SCORES = 1 << 20  # padded query-key pairs per group (per head): bounds the mask and SDPA's scores
MAX_GROUP_KEYS = 1 << 14  # gathered key positions per group (sequences x padded context): bounds the K/V copy
MAX_SEQ_SCORES = 1 << 16  # a sequence with more query-key pairs is one large SDPA call of its own: not batched


@dataclass
class PrefillGroup:
    """Sequences that share one K/V gather and one SDPA call (see `plan_prefill_groups`)."""

    num_seqs: int
    num_blocks: int  # blocks gathered per sequence: the group's longest context, block aligned
    query_len: int  # the group's longest query (padded query rows per sequence)
    block_ids: torch.Tensor  # [G * num_blocks] int64: cache blocks, row-major by sequence (padding -> block 0)
    key_len: int  # keys SDPA reads per sequence (S): query_len in a fresh group, else num_blocks * BS
    key_pad: torch.Tensor | None  # [G, S, 1, 1] bool: gathered positions past their sequence's end (None: none read)
    query_rows: torch.Tensor  # [G * query_len] int64: the step's query row behind each padded row
    mask: torch.Tensor | None  # [G, 1, query_len, S] bool: True where the query may see the key; None: is_causal
    real_rows: torch.Tensor  # [N] int64: padded rows (of G * query_len) that are real queries
    out_rows: torch.Tensor  # [N] int64: their rows in the step's output


def _cut_groups(seqs: list[tuple[int, int]]) -> list[list[int]]:
    """Indices into `seqs` ((q_len, seq_len) each) cut into groups: fresh prompts (q_len == seq_len) apart from
    sequences with a cached prefix, longest context first."""
    order = sorted(range(len(seqs)), key=lambda i: (seqs[i][0] < seqs[i][1], -seqs[i][1]))
    groups: list[list[int]] = []
    current: list[int] = []
    longest_q = real_area = 0
    for i in order:
        q_len, seq_len = seqs[i]
        if current:
            context = seqs[current[0]][1]
            n = len(current) + 1
            padded = n * max(longest_q, q_len) * context
            if (
                (q_len == seq_len) != (seqs[current[0]][0] == context)
                or n > MAX_GROUP_SEQS
                or padded > MAX_GROUP_SCORES
                or n * context > MAX_GROUP_KEYS
                or padded > PAD_AREA_LIMIT * (real_area + q_len * seq_len)
            ):
                groups.append(current)
                current, longest_q, real_area = [], 0, 0
        current.append(i)
        longest_q = max(longest_q, q_len)
        real_area += q_len * seq_len
    if current:
        groups.append(current)
    return groups


def plan_prefill_groups(
    block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int], seqs: list[int], block_size: int
) -> list[PrefillGroup]:
    """Groups of the prefill sequences `seqs` (indices into `seq_lens` / rows of `block_tables`; each with
    0 < q_len <= seq_len) for `prefill_groups`."""
    # block_tables: [B, M] int32; query_start_loc: B+1 ints; seq_lens: B ints
    device = block_tables.device
    shapes = [(query_start_loc[b + 1] - query_start_loc[b], seq_lens[b]) for b in seqs]
    plan = []
    for members in _cut_groups(shapes):
        ids = [seqs[m] for m in members]
        q_lens = torch.tensor([shapes[m][0] for m in members], dtype=torch.long)  # [G]
        lens = torch.tensor([shapes[m][1] for m in members], dtype=torch.long)  # [G]
        starts = torch.tensor([query_start_loc[b] for b in ids], dtype=torch.long)  # [G]
        n, query_len, longest = len(ids), int(q_lens.max()), int(lens.max())
        num_blocks = -(-longest // block_size)
        rows = torch.tensor(ids, dtype=torch.long, device=device)
        table = block_tables[rows, :num_blocks].to(torch.long)  # [G, nblk]
        needed = torch.arange(num_blocks, device=device) < (-(-lens // block_size)).to(device)[:, None]  # [G, nblk]
        block_ids = torch.where(needed, table, 0).reshape(-1)  # [G * nblk]
        i = torch.arange(query_len)  # [Qmax]
        real = i[None, :] < q_lens[:, None]  # [G, Qmax]
        query_rows = (starts[:, None] + torch.minimum(i[None, :], q_lens[:, None] - 1)).reshape(-1)  # [G * Qmax]
        real_rows = real.reshape(-1).nonzero().squeeze(1)  # [N]
        fresh = bool((q_lens == lens).all())
        # fresh prompts: SDPA's own causal mask over the first Qmax keys (a real row i sees keys 0..i, all its own)
        key_len = query_len if fresh else num_blocks * block_size
        k = torch.arange(key_len)  # [S]
        inside = k[None, :] < lens[:, None]  # [G, S]
        # zeroed even where masked: SDPA multiplies a masked key's 0 weight by its value (NaN * 0 is NaN)
        key_pad = None if bool(inside.all()) else (~inside)[:, :, None, None].to(device)
        mask = None
        if not fresh:
            # query i of sequence b sits at position seq_len - q_len + i; padded rows (i >= q_len) see all its keys
            mask = (k[None, None, :] <= (lens - q_lens)[:, None, None] + i[None, :, None]) & inside[:, None, :]
            mask = mask[:, None].to(device)  # [G, 1, Qmax, S]
        plan.append(
            PrefillGroup(
                num_seqs=n,
                num_blocks=num_blocks,
                query_len=query_len,
                block_ids=block_ids,
                key_len=key_len,
                key_pad=key_pad,
                query_rows=query_rows.to(device),
                mask=mask,
                real_rows=real_rows.to(device),
                out_rows=query_rows[real_rows].to(device),
            )
        )
    return plan


def _gather_group(cache: torch.Tensor, group: PrefillGroup, scale: float, dtype: torch.dtype) -> torch.Tensor:
    # cache: [NB, BS, Hkv, D] -> [G, Hkv, S, D] contiguous in `dtype`, S = key_len, zero past each length (key_pad)
    _, block_size, num_kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, group.block_ids)  # [G * nblk, BS, Hkv, D]
    context = blocks.view(group.num_seqs, group.num_blocks * block_size, num_kv_heads, head_dim)[:, : group.key_len]
    if is_fp8(cache):
        context = dequantize_kv(context, scale, dtype)
    if group.key_pad is not None:
        context = context.masked_fill_(group.key_pad, 0)  # never-written slots may hold NaN/inf
    return context.transpose(1, 2).contiguous()


def prefill_groups(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: list[PrefillGroup],
    scale: float,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Causal attention of each planned sequence's queries (the last q_len of its seq_len positions) over its cached
    context, written into `out` (FP8 caches: dequantized with k_scale / v_scale)."""
    # query, out: [T, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]
    num_q_heads, head_dim = query.shape[1:]
    gqa = num_q_heads != k_cache.shape[2]
    for group in plan:
        k = _gather_group(k_cache, group, k_scale, query.dtype)  # [G, Hkv, S, D]
        v = _gather_group(v_cache, group, v_scale, query.dtype)
        q = query.index_select(0, group.query_rows).view(group.num_seqs, group.query_len, num_q_heads, head_dim)
        q = q.transpose(1, 2)  # [G, Hq, Qmax, D]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=group.mask, is_causal=group.mask is None, scale=scale, enable_gqa=gqa
        )  # [G, Hq, Qmax, D]
        o = o.transpose(1, 2).reshape(-1, num_q_heads, head_dim)  # [G * Qmax, Hq, D]
        out.index_copy_(0, group.out_rows, o.index_select(0, group.real_rows))


def batchable_prefills(
    query_start_loc: list[int], seq_lens: list[int], bidirectional: tuple[bool, ...] = ()
) -> list[int]:
    """The sequences `prefill_groups` takes when there are at least two: causal (not flagged in `bidirectional`)
    with 0 < q_len <= seq_len and q_len * seq_len <= MAX_SEQ_SCORES. Callers send sliding-window layers down the
    per-sequence path."""
    seqs = []
    for b, seq_len in enumerate(seq_lens):
        q_len = query_start_loc[b + 1] - query_start_loc[b]
        if 0 < q_len <= seq_len and q_len * seq_len <= MAX_SEQ_SCORES and not (bidirectional and bidirectional[b]):
            seqs.append(b)
    return seqs if len(seqs) >= 2 else []


def step_prefill_groups(md: AttentionMetadata, block_size: int) -> list[PrefillGroup]:
    """The groups of the step's prefill sequences (md.num_decodes ..): planned on the first layer's call, then read
    from `md.derived`."""
    n = md.num_decodes
    starts, lens = md.query_start_loc_cpu[n:], md.seq_lens_cpu[n:]
    return md.derive(
        ("prefill_groups", block_size),
        lambda: plan_prefill_groups(
            md.block_tables[n:], starts, lens, batchable_prefills(starts, lens, bidirectional_prefills(md)), block_size
        ),
    )
