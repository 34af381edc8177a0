"""Per-query key limits (`AttentionMetadata.key_limits`): the image tokens of Gemma 3 attend bidirectionally within
their image during prefill.

A query at position q with limit h attends key k iff k <= h, and with a sliding window W also k > q - W (HF 5.x
Gemma 3: AND(sliding window of q, OR(causal, same image block))). Only the torch prefill path applies limits
(`attention_ref._prefill_from_lists`): the C++ CPU call then attends the decodes only, and the Triton path sends its
prefill sequences to the torch path. A step none of whose limits passes its own position runs exactly as a causal
one, and so does every prefill sequence without such a token (`bidirectional_prefills`).
"""

from __future__ import annotations

import torch

from vlserve.kernels.metadata import AttentionMetadata


def bidirectional_prefills(md: AttentionMetadata) -> tuple[bool, ...]:
    """For each prefill sequence of the step (md.num_decodes ..), whether one of its query tokens may attend past
    its own position; () when none does (or md.key_limits is None): the step is causal. Worked out (one host sync)
    on the step's first call, then read from `md.derived`."""
    if md.key_limits is None:
        return ()
    return md.derive("bidirectional_prefills", lambda: _bidirectional_prefills(md))


def _bidirectional_prefills(md: AttentionMetadata) -> tuple[bool, ...]:
    qsl, lens, num_decodes = md.query_start_loc_cpu, md.seq_lens_cpu, md.num_decodes
    start, end = qsl[num_decodes], qsl[-1]
    if end == start:  # no prefill token (decode-only steps never sync)
        return ()
    device = md.key_limits.device
    seqs = range(num_decodes, len(lens))
    q_lens = torch.tensor([qsl[b + 1] - qsl[b] for b in seqs], device=device)  # [P]
    # token t of sequence b sits at position seq_len_b - qsl[b + 1] + t
    offsets = torch.tensor([lens[b] - qsl[b + 1] for b in seqs], dtype=torch.long, device=device)  # [P]
    seq_ids = torch.repeat_interleave(
        torch.arange(len(q_lens), device=device), q_lens, output_size=end - start
    )  # [end - start]
    own = offsets[seq_ids] + torch.arange(start, end, device=device)  # [end - start]
    beyond = (md.key_limits[start:end] > own).to(torch.long)  # [end - start]
    counts = torch.zeros(len(q_lens), dtype=torch.long, device=device).index_add_(0, seq_ids, beyond)  # [P]
    flags = tuple((counts > 0).tolist())
    return flags if any(flags) else ()


def key_limit_mask(
    limits: torch.Tensor, first_query: int, first_key: int, seq_len: int, sliding_window: int | None
) -> torch.Tensor:
    """[q_len, S] bool: query i (at position first_query + i, limit limits[i]) may see key first_key + j."""
    # limits: [q_len] int64
    device = limits.device
    k_pos = torch.arange(first_key, seq_len, device=device)  # [S]
    mask = k_pos[None, :] <= limits[:, None]
    if sliding_window is not None:
        q_pos = torch.arange(first_query, first_query + limits.shape[0], device=device)  # [q_len]
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask
