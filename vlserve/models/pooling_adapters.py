"""Sequence classifiers over the Llama-family decoder (HF `*ForSequenceClassification`): the decoder plus a
`score` projection `[num_labels, H]` in place of `lm_head`, which a pooling runner applies to the pooled (last
token's) hidden state."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from vlserve.models.causal_lm import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from vlserve.models.llama import AbsentOnStage


class _ScoreHead:
    """Mixed into a causal LM class: no `lm_head`, a `score` linear (no bias), loaded from `score.weight`."""

    def __init__(self, config) -> None:
        super().__init__(config)
        num_labels = getattr(config, "num_labels", None) or len(getattr(config, "id2label", None) or {}) or 1
        self.lm_head = AbsentOnStage()
        self.score = nn.Linear(config.hidden_size, num_labels, bias=False)

    def tie_weights(self) -> None:
        """Nothing to tie: the head is `score`."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden [N, H]` -> class logits `[N, num_labels]` float32."""
        return self.score(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The decoder's `model.*` as the causal LM loads them, plus `score.weight`; ValueError when it is
        missing."""
        found = []

        def without_score():
            for name, tensor in weights:
                if name == "score.weight":
                    self.score.weight.copy_(tensor)
                    found.append(name)
                else:
                    yield name, tensor

        super().load_weights(without_score())
        if not found:
            raise ValueError("checkpoint is missing score.weight (a *ForSequenceClassification head)")


class LlamaForSequenceClassification(_ScoreHead, LlamaForCausalLM):
    """Llama decoder + `score`."""

    capabilities = replace(LlamaForCausalLM.capabilities, classifier_head=True)


class Qwen2ForSequenceClassification(_ScoreHead, Qwen2ForCausalLM):
    """Qwen2 decoder + `score`."""

    capabilities = replace(Qwen2ForCausalLM.capabilities, classifier_head=True)


class Qwen3ForSequenceClassification(_ScoreHead, Qwen3ForCausalLM):
    """Qwen3 decoder + `score`."""

    capabilities = replace(Qwen3ForCausalLM.capabilities, classifier_head=True)
