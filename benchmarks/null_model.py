"""A null model for host-step benchmarks: the runner's forward and logits return preset tensors at once.

`install_null_model(llm)` swaps the runner's `forward` (a `ModelForward`) and the model's `compute_logits` on the
instance; everything else (scheduler, input preparation, sampling on real logits, output processing, detokenizing)
is the engine's own. The null decoder answers each token with `(token + 1) % V`: its hidden state row carries the
input id in column 0, and its logits row is a preset one-hot row of the next id, so greedy outputs are known in
advance (`expected_tokens`).
"""

from __future__ import annotations

import time

import torch


class NullForward:
    """`forward(input_ids [T], positions, kv_caches, md, inputs_embeds) -> hidden [T, H]`: a preset buffer whose
    column 0 holds the input ids (no layers, no KV writes)."""

    def __init__(self, max_tokens: int, hidden_size: int, device: torch.device):
        self.hidden = torch.zeros(max_tokens, hidden_size, device=device)  # [T_max, H]
        self.num_calls = 0
        self.seconds = 0.0  # spent in these calls (the null model's own share of a step)
        self.logits: NullLogits | None = None  # its logits half (set by install_null_model)

    def __call__(self, input_ids, positions, kv_caches, md, inputs_embeds=None) -> torch.Tensor:
        t = time.perf_counter()
        self.num_calls += 1
        hidden = self.hidden[: input_ids.shape[0]]  # [T, H]
        hidden[:, 0].copy_(input_ids)
        self.seconds += time.perf_counter() - t
        return hidden


class NullLogits:
    """`compute_logits(hidden [N, H]) -> logits [N, V]`: the preset row of the id in column 0 (one-hot of id + 1)."""

    def __init__(self, vocab_size: int, device: torch.device):
        nxt = (torch.arange(vocab_size, device=device) + 1) % vocab_size  # [V]
        self.table = torch.nn.functional.one_hot(nxt, vocab_size).float()  # [V, V]
        self.seconds = 0.0  # spent in these calls (copying N rows of the table)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        logits = self.table.index_select(0, hidden[:, 0].long())  # [N, V]
        self.seconds += time.perf_counter() - t
        return logits


def install_null_model(llm) -> NullForward:
    """Swap the model's forward and logits of `llm`'s runner for the null ones (in-process engines only)."""
    runner = llm.engine.runner
    config = llm.engine.loaded.hf_config
    text = getattr(config, "text_config", None) or config
    forward = NullForward(llm.engine.scheduler.config.max_num_batched_tokens, text.hidden_size, runner.device)
    runner.forward = forward
    runner.model.compute_logits = forward.logits = NullLogits(text.vocab_size, runner.device)
    return forward


def null_model_seconds(forward: NullForward) -> float:
    """Seconds spent so far inside the null forward and logits (installed together by `install_null_model`)."""
    return forward.seconds + forward.logits.seconds


def expected_tokens(prompt_token_ids: list[int], num_tokens: int, vocab_size: int) -> list[int]:
    """The null model's greedy output: each token the previous one plus 1, modulo the vocabulary."""
    out, last = [], prompt_token_ids[-1]
    for _ in range(num_tokens):
        last = (last + 1) % vocab_size
        out.append(last)
    return out
