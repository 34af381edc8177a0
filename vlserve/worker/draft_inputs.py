"""What a spec-decode proposer is handed after a target step (`DraftInputs`), built from the runner's step."""

from __future__ import annotations

import numpy as np
import torch

from vlserve.models.llama import decoder_of
from vlserve.worker.proposer import DraftInputs


def build_draft_inputs(
    runner,
    states,
    starts: np.ndarray,
    q_lens: np.ndarray,
    cu: np.ndarray,
    positions,
    hidden,
    md,
    sample_idx: np.ndarray,
) -> DraftInputs:
    """The proposer's view of the step `runner` just ran (after sampling: token_ids already hold the new tokens).
    states: the batch's requests ([B], decodes first); starts / q_lens [B]; cu [B + 1]; positions [T] or [3, T];
    hidden [T, H]; sample_idx: the batch rows that sampled."""
    sampled = [states[i] for i in sample_idx]
    inputs = DraftInputs(req_ids=[s.req_id for s in sampled], token_ids=[s.token_ids for s in sampled])
    if not runner.uses_hidden_states:
        return inputs
    # Row of position p carries token p + 1 (0 past the known tokens: rejected drafts).
    ids: list[int] = []
    for state, s, n in zip(states, starts.tolist(), q_lens.tolist()):
        nxt = state.token_ids[s + 1 : s + n + 1]
        ids.extend(nxt)
        if len(nxt) < n:
            ids.extend([0] * (n - len(nxt)))
    inputs.input_ids = torch.tensor(ids, dtype=torch.long, device=runner.device)  # [T]
    decoder = decoder_of(runner.model)
    if any(state.mm_features for state in states):
        embeds = runner.merge_mm_embeddings(
            inputs.input_ids, states, starts + 1, q_lens, cu, skip_missing=True
        )  # [T, W] or None
        # the draft takes the H-wide token rows (Qwen3-VL's rows also carry DeepStack features past H)
        inputs.inputs_embeds = None if embeds is None else embeds[:, : decoder.hidden_size]
    L = np.array([len(s.token_ids) for s in sampled], dtype=np.int64)
    inputs.positions, inputs.hidden_states, inputs.attn_metadata = positions, hidden, md
    inputs.aux_hidden_states = decoder.aux_hidden_states
    inputs.last_rows = cu[:-1][sample_idx] + (L - 2 - starts[sample_idx])
    inputs.seq_lens = L
    inputs.batch_rows = np.asarray(sample_idx, dtype=np.int64)
    inputs.num_slots = np.array([len(s.block_ids) * runner.block_size for s in sampled], dtype=np.int64)
    if runner.mrope_positions_fn is not None:
        inputs.mrope_deltas = np.array([s.mrope_delta for s in sampled], dtype=np.int64)
    inputs.batch_req_ids = [s.req_id for s in states]
    inputs.batch_starts = starts
    inputs.batch_num_valid = np.minimum(q_lens, np.array([len(s.token_ids) for s in states]) - 1 - starts)
    return inputs
