"""Prompt logprobs: per prompt token after the first, the log-softmax of the logits at the position before it,
read at the token itself (its logprob and rank) and at the top k, gathered chunk by chunk as the prompt is computed
(chunked prefill) and handed out when the prompt's last chunk has run."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from vlserve.sampling_params import SamplingParams
from vlserve.worker.request_state import CachedRequestState

# (the prompt token's id then the top-k ids, their logprobs, the prompt token's rank); None: not computed here
PromptLogprobEntry = tuple[list[int], list[float], int] | None

ROWS_PER_CALL = 256  # logits rows computed at once ([256, V] float32)


def prompt_logprob_entries(
    model, hidden: torch.Tensor, next_token_ids: list[int], k: int
) -> list[tuple[list[int], list[float], int]]:
    """hidden [N, H] of N consecutive positions; next_token_ids[j]: the prompt token after position j."""
    entries = []
    for lo in range(0, hidden.shape[0], ROWS_PER_CALL):
        rows = hidden[lo : lo + ROWS_PER_CALL]
        logprobs = torch.log_softmax(model.compute_logits(rows).float(), dim=-1)  # [n, V]
        targets = torch.tensor(next_token_ids[lo : lo + rows.shape[0]], device=logprobs.device).unsqueeze(1)
        target_lp = logprobs.gather(1, targets)  # [n, 1]
        ranks = ((logprobs > target_lp).sum(dim=-1) + 1).tolist()  # [n]
        ids, vals = targets, target_lp
        if k > 0:
            top_lp, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # [n, k]
            ids, vals = torch.cat([targets, top_ids], dim=1), torch.cat([target_lp, top_lp], dim=1)
        entries.extend(zip(ids.tolist(), vals.tolist(), ranks))
    return entries


class PromptLogprobsCollector:
    """The runner's prompt logprobs in progress: request id -> the entries of the positions computed so far."""

    def __init__(self):
        self.partial: dict[str, list[PromptLogprobEntry]] = {}

    def start(self, req_id: str, params: SamplingParams, num_output_tokens: int) -> None:
        """Track a request the runner starts (or restarts), unless it asked for none or already has outputs (its
        prompt logprobs went out with its first token)."""
        if params.prompt_logprobs is not None and num_output_tokens == 0:
            self.partial[req_id] = []

    def drop(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.partial.pop(rid, None)

    def collect(
        self,
        model,
        hidden: torch.Tensor,
        states: list[CachedRequestState],
        starts: np.ndarray,
        q_lens: np.ndarray,
        cu: np.ndarray,
    ) -> dict[str, list[PromptLogprobEntry]]:
        """Add this step's windows (hidden [T, H]; request i's rows cu[i] .. cu[i + 1]) and return the finished
        requests' entries. Positions skipped without a forward here (a KV load) get None."""
        done = {}
        for i, state in enumerate(states):
            entries = self.partial.get(state.req_id)
            if entries is None:
                continue
            start, n, num_prompt = int(starts[i]), int(q_lens[i]), state.num_prompt_tokens
            del entries[start:]
            entries.extend([None] * (start - len(entries)))
            end = min(start + n, num_prompt - 1)  # position num_prompt - 1 predicts the first output token
            if end > start:
                row = int(cu[i])
                entries.extend(
                    prompt_logprob_entries(
                        model,
                        hidden[row : row + end - start],
                        state.token_ids[start + 1 : end + 1],
                        state.sampling_params.prompt_logprobs,
                    )
                )
            if start + n >= num_prompt:
                done[state.req_id] = self.partial.pop(state.req_id)
        return done
