"""The sampling half of a runner step: pick logits rows, sample (or verify drafts), collect tokens and logprobs."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vlserve.kernels.host_copy import to_device
from vlserve.worker.grammar_mask import apply_grammar_bitmask
from vlserve.worker.rejection_sampler import RejectionSampler, build_spec_sampling_metadata
from vlserve.worker.request_state import CachedRequestState
from vlserve.worker.sampler import Sampler, build_sampling_metadata


@dataclass
class StepSamples:
    """Per sampled request: emitted tokens (accepted drafts + 1) and, when asked, one logprob entry per token."""

    token_lists: list[list[int]] = field(default_factory=list)  # in the order of the sampled states
    logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    # `keep_on_device`: [S] int64 sampled ids, and (top ids [S, k+1], their logprobs, sampled ranks [S]) or None,
    # left on the device unread (tokens and logprobs then stay empty)
    device_tokens: torch.Tensor | None = None
    device_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def logprob_lists(
    states: list[CachedRequestState], emitted: list[int], strides: list[int], lp_ids: list, lp_vals: list, ranks: list
) -> dict[str, list[tuple[list[int], list[float], int]]]:
    """Per request that asked for logprobs: (top ids, their logprobs, the sampled token's rank) per emitted token;
    request i has emitted[i] tokens and its rows start at sum(strides[:i]) of the read-back lists."""
    result = {}
    base = 0
    for state, n, stride in zip(states, emitted, strides):
        k = state.sampling_params.logprobs
        if k is not None:
            result[state.req_id] = [
                (lp_ids[base + j][: k + 1], lp_vals[base + j][: k + 1], ranks[base + j]) for j in range(n)
            ]
        base += stride
    return result


class TokenSlices(Sequence):
    """Each state's prompt (or output) token ids as a read-only list-like, sliced only when a row is read: most
    steps read none, and copying every request's tokens each step would grow with the sequence lengths."""

    def __init__(self, states: list[CachedRequestState], prompt: bool):
        self.states = states
        self.prompt = prompt

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> list[int]:
        state = self.states[i]
        return state.prompt_token_ids if self.prompt else state.output_token_ids


class StepSampler:
    """Plain sampling for ordinary steps; the exact rejection sampler when any request carries drafts."""

    def __init__(self):
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        # the last plain step's metadata when no row of it changes from step to step (greedy, no penalties, no
        # min_tokens, no bad words): (its states, vocab, the metadata)
        self._static_md: tuple | None = None

    def _metadata(self, states: list[CachedRequestState], vocab: int, device):
        """build_sampling_metadata, or the last step's when the rows are the same states in the same order and
        nothing in their params depends on the step (greedy rows read neither generators nor token counts)."""
        cached = self._static_md
        if (
            cached is not None
            and cached[1] == vocab
            and len(cached[0]) == len(states)
            and all(map(operator.is_, cached[0], states))
        ):
            return cached[2]
        params = [s.sampling_params for s in states]
        gens = [s.generator for s in states]
        prompts = TokenSlices(states, prompt=True)  # read only for penalties / min_tokens / bad words rows
        outputs = TokenSlices(states, prompt=False)
        md = build_sampling_metadata(params, gens, prompts, outputs, vocab, device)
        adjustment = md.logits_adjustment
        static = (
            md.all_greedy
            and md.no_penalties
            and all(p.min_tokens == 0 for p in params)
            and (adjustment is None or not adjustment.reads_outputs)
        )
        self._static_md = (list(states), vocab, md) if static else None
        return md

    def sample(
        self,
        model,
        hidden: torch.Tensor,
        states: list[CachedRequestState],
        ends: np.ndarray,
        drafts: list[list[int]],
        grammar_bitmask: np.ndarray | None = None,
        grammar_rows: dict[str, int] | None = None,
        keep_on_device: bool = False,
    ) -> StepSamples:
        """hidden: [T, H]; ends[i] (increasing): index after request i's last token in the batch; drafts[i]: its
        verified draft tokens (they sit at the last len(drafts[i]) positions of its window, before the bonus
        position). grammar_bitmask / grammar_rows: the structured-output token bitmask of the step (see
        SchedulerOutput), applied to the logits before sampling or verifying. keep_on_device: a step without drafts
        returns its one token per request (and logprobs) on the device, unread, and appends nothing."""
        # Rows: the k_i draft positions + the bonus position of each request (just the last token without drafts).
        any_drafts = any(drafts)
        if any_drafts:
            rows = np.concatenate([np.arange(e - len(d) - 1, e) for e, d in zip(ends.tolist(), drafts)])
        else:
            rows = np.asarray(ends, dtype=np.int64) - 1
        if len(rows) and rows[-1] == len(rows) - 1:  # increasing rows that end at n - 1 are all of 0..n-1
            picked = hidden[: len(rows)]
        else:
            picked = hidden.index_select(0, to_device(torch.from_numpy(rows), hidden.device))
        logits = model.compute_logits(picked)  # [sum(k_i + 1), V]
        if grammar_bitmask is not None:
            apply_grammar_bitmask(
                logits, grammar_bitmask, grammar_rows, [s.req_id for s in states], [len(d) + 1 for d in drafts]
            )
        vocab = logits.shape[-1]
        if any_drafts:
            params = [s.sampling_params for s in states]
            gens = [s.generator for s in states]
            prompts, outputs = TokenSlices(states, prompt=True), TokenSlices(states, prompt=False)
            md = build_spec_sampling_metadata(params, gens, prompts, outputs, drafts, vocab, logits.device)
            out = self.rejection_sampler(logits, drafts, None, md)
            token_lists = out.to_lists()
        else:
            md = self._metadata(states, vocab, logits.device)
            out = self.sampler(logits, md)
            if keep_on_device:
                return StepSamples(
                    device_tokens=out.sampled_token_ids,
                    device_logprobs=None
                    if out.logprobs is None
                    else (out.logprob_token_ids, out.logprobs, out.sampled_ranks),
                )
            flat = out.sampled_token_ids.tolist()
            token_lists = [[t] for t in flat]
        result = StepSamples(token_lists)
        if any_drafts:
            for state, toks in zip(states, token_lists):
                state.token_ids.extend(toks)
        else:
            for state, tok in zip(states, flat):
                state.token_ids.append(tok)
        if out.logprobs is not None:
            result.logprobs = logprob_lists(
                states,
                [len(t) for t in token_lists],
                [len(d) + 1 for d in drafts],
                out.logprob_token_ids.tolist(),
                out.logprobs.tolist(),
                out.sampled_ranks.tolist(),
            )
        return result
