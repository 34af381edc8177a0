"""The pooling runner's one step: pool the final hidden states of each request's prompt (LAST, MEAN, CLS or ALL,
accumulated over chunked prefill) and run the pooling head, in place of the LM head and the sampler."""

from __future__ import annotations

import numpy as np
import torch

from vlserve.models.capabilities import capabilities_of
from vlserve.pooling_params import PoolerSpec


class Pooler:
    """Pools prompts' hidden states; `head` maps pooled `[N, H]` to `[N, L]` (None: the embedding itself).
    Partial pools (MEAN's running sum, CLS's first state, ALL's chunks) are kept per request between chunks."""

    def __init__(self, spec: PoolerSpec, head: torch.nn.Module | None = None):
        self.spec = spec
        self.head = head
        self.partial: dict[str, list[torch.Tensor]] = {}  # request -> float32 [H] sums / states, or ALL's chunks

    def drop(self, req_ids) -> None:
        """Forget the partial pools of finished or preempted requests."""
        for rid in req_ids:
            self.partial.pop(rid, None)

    def output_rows(self, cu: np.ndarray, ending: np.ndarray, device) -> torch.Tensor | None:
        """The step's only rows the pool reads (`AttentionMetadata.output_rows`): LAST's last prompt rows of the
        requests whose prompt ends this step; None for the other kinds, or when none ends (every row is computed)."""
        if self.spec.pooling_type != "LAST" or not len(ending):
            return None
        return torch.as_tensor(cu[1:][ending] - 1, device=device)  # [K] int64, increasing

    @torch.inference_mode()
    def pool(
        self,
        hidden: torch.Tensor,
        req_ids: list[str],
        starts: np.ndarray,
        cu: np.ndarray,
        num_prompt_tokens: list[int],
        ending: np.ndarray,
    ) -> dict[str, torch.Tensor]:
        """`hidden [T, H]` of this step (request i's window: rows cu[i]:cu[i+1], from prompt position starts[i]),
        or `[K, H]`: the `output_rows` alone, where the model took them; `ending`: the indices of requests whose
        prompt ends this step. Returns their results, float32 on the CPU,
        each its own storage: [D] or [L] (a head), [P, H] for ALL."""
        kind = self.spec.pooling_type
        if kind != "LAST":  # accumulate every request's window
            for i, rid in enumerate(req_ids):
                rows = hidden[int(cu[i]) : int(cu[i + 1])].float()  # [q, H]
                acc = self.partial.setdefault(rid, [])
                if kind == "MEAN":
                    acc.append(rows.sum(dim=0))  # [H]
                elif kind == "CLS" and int(starts[i]) == 0:
                    acc.append(rows[0])  # [H]
                elif kind == "ALL":
                    acc.append(rows)  # [q, H]
        if not len(ending):
            return {}
        ids = [req_ids[i] for i in ending.tolist()]
        if kind == "LAST" and hidden.shape[0] != int(cu[-1]):  # the model returned the last rows alone
            pooled = hidden.float()  # [N, H]
        elif kind == "LAST":
            pooled = hidden[torch.as_tensor(cu[1:][ending] - 1, device=hidden.device)].float()  # [N, H]
        elif kind == "ALL":
            return {rid: torch.cat(self.partial.pop(rid)).cpu() for rid in ids}  # [P, H] each
        elif kind == "MEAN":
            pooled = torch.stack(
                [torch.stack(self.partial.pop(req_ids[i])).sum(dim=0) / num_prompt_tokens[i] for i in ending.tolist()]
            )  # [N, H]
        else:  # CLS
            pooled = torch.stack([self.partial.pop(rid)[0] for rid in ids])  # [N, H]
        if self.head is not None:
            pooled = self.head(pooled)  # [N, L]
        pooled = pooled.cpu()
        return {rid: pooled[k].clone() for k, rid in enumerate(ids)}  # (a view would pickle the whole batch)


class LogitsHead(torch.nn.Module):
    """The model's own head (`compute_logits`: a classifier's `score`, or the LM head) over pooled states; with
    `token_ids`, only those logits: one token -> its logit `[N, 1]`, (a, b) -> logit(b) - logit(a) `[N, 1]` (the
    "no" / "yes" reranker layout)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, token_ids: tuple[int, ...] = ()):
        super().__init__()
        self.model = model
        self.dtype = dtype  # the model's: what its head takes
        self.token_ids = list(token_ids)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(pooled.to(self.dtype)).float()  # [N, V] or [N, num_labels]
        if not self.token_ids:
            return logits
        picked = logits[:, self.token_ids]  # [N, k]
        return picked if len(self.token_ids) == 1 else picked[:, 1:] - picked[:, :1]  # [N, 1]


def build_pooler(model: torch.nn.Module, spec: PoolerSpec, dtype: torch.dtype) -> Pooler:
    """The runner's pooler for `spec`: a classifier's head is LM-head rows (`classifier_token_ids`) or the model's
    own `score` layer (a *ForSequenceClassification checkpoint)."""
    if spec.task == "embed":
        return Pooler(spec)
    if spec.classifier_token_ids:
        return Pooler(spec, LogitsHead(model, dtype, spec.classifier_token_ids))
    if not capabilities_of(model).classifier_head:
        raise ValueError(
            "this model has no classifier head: serve a *ForSequenceClassification checkpoint, or give "
            'pooler_config classifier_from_token (LM-head rows, e.g. ["no", "yes"])'
        )
    return Pooler(spec, LogitsHead(model, dtype))
