"""`LLM`'s pooling calls (vLLM's shapes): `encode`, `embed`, `classify` and `score`, for an engine started with
`runner="pooling"` (or a checkpoint that pools on its own)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from vlserve.engine.engine_loop import NewRequest
from vlserve.engine.input_processor import ProcessedPrompt
from vlserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from vlserve.pooling_params import PoolingParams


class PoolingCalls:
    """Mixed into `LLM`: the calls of a pooling engine (each a ValueError on a generation engine)."""

    def encode(
        self, prompts: Any, pooling_params: PoolingParams | None = None, use_tqdm: bool = True, lora_request=None
    ) -> list[PoolingRequestOutput]:
        """Pool one prompt or a list (strings, token-id lists, {"prompt", "multi_modal_data"} dicts, or
        OpenAI-format conversations); the raw pooled tensors (task "encode" unless `pooling_params` says)."""
        processed = self._process_prompts(prompts, None, None, None, None, conversations=True)
        return self._run_pooling(processed, _params_for(pooling_params, None, len(processed)), use_tqdm, lora_request)

    def embed(
        self, prompts: Any, pooling_params: PoolingParams | None = None, use_tqdm: bool = True, lora_request=None
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (prompts as in `encode`): `.outputs.embedding`, a list of floats."""
        processed = self._process_prompts(prompts, None, None, None, None, conversations=True)
        params = _params_for(pooling_params, "embed", len(processed))
        return [
            EmbeddingRequestOutput.from_base(o) for o in self._run_pooling(processed, params, use_tqdm, lora_request)
        ]

    def classify(
        self, prompts: Any, pooling_params: PoolingParams | None = None, use_tqdm: bool = True, lora_request=None
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (prompts as in `encode`): `.outputs.probs`."""
        processed = self._process_prompts(prompts, None, None, None, None, conversations=True)
        params = _params_for(pooling_params, "classify", len(processed))
        outs = self._run_pooling(processed, params, use_tqdm, lora_request)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        data_1: str | dict | list,
        data_2: str | dict | list,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request=None,
    ) -> list[ScoringRequestOutput]:
        """Score query / document pairs: one query against many documents, or pairwise lists of equal length. A
        classifier scores each pair tokenized together (the tokenizer's text pair); an embedder, the cosine of
        the two embeddings (an embedder's items may be prompt dicts too: a dual tower scores a text against an
        image). `.outputs.score` per pair."""
        queries = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        docs = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        if len(queries) == 1:
            queries = queries * len(docs)
        if len(queries) != len(docs) or not docs:
            raise ValueError(f"score needs one query or as many as documents, got {len(queries)} and {len(docs)}")
        if isinstance(pooling_params, (list, tuple)):
            raise ValueError("score takes one PoolingParams for every pair")
        tasks = self.engine.pooling_tasks
        if "score" not in tasks and "embed" not in tasks:
            raise ValueError(f"this engine does not score; it serves {sorted(tasks) or 'generation'}")
        # an embedder also takes prompt dicts ({"prompt": "", "multi_modal_data": {"image": ...}} on a dual tower)
        dicts = "embed" in tasks
        if not all(isinstance(t, (str, dict) if dicts else str) for t in queries + docs):
            raise ValueError("score takes strings (or lists of strings)" + (", or prompt dicts" if dicts else ""))
        if "embed" in tasks:
            embeds = self.embed(queries + docs, pooling_params, use_tqdm, lora_request)
            vectors = torch.tensor([e.outputs.embedding for e in embeds])  # [2N, D]
            q, d = vectors[: len(docs)], vectors[len(docs) :]
            scores = torch.nn.functional.cosine_similarity(q, d, dim=-1).tolist()
            ids = [e.prompt_token_ids + f.prompt_token_ids for e, f in zip(embeds[: len(docs)], embeds[len(docs) :])]
            return [ScoringRequestOutput(str(i), ScoringOutput(s), t) for i, (s, t) in enumerate(zip(scores, ids))]
        params = _params_for(pooling_params, "score", len(queries))
        processed = [ProcessedPrompt(None, self.tokenizer(q, d)["input_ids"], []) for q, d in zip(queries, docs)]
        outs = self._run_pooling(processed, params, use_tqdm, lora_request)
        return [
            ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[-1])), o.prompt_token_ids)
            for o in outs
        ]

    def _run_pooling(
        self, processed: list[ProcessedPrompt], params: list[PoolingParams], use_tqdm: bool, lora_request=None
    ) -> list[PoolingRequestOutput]:
        loras = self._lora_requests(lora_request, len(processed))
        for lora in dict.fromkeys(r for r in loras if r is not None):
            self.engine_loop.core.add_lora(lora)
        now = time.time()
        requests = [
            NewRequest(str(next(self._ids)), proc, p, now, lora) for proc, p, lora in zip(processed, params, loras)
        ]
        with self._lock:
            self.engine_loop.add_pooling_requests(requests)
            return self._drain([r.request_id for r in requests], use_tqdm)


def _params_for(pooling_params, task: str | None, n: int) -> list[PoolingParams]:
    """One PoolingParams per prompt from None, one, or a list of n; `task` (the call's) replaces theirs, None keeps
    it (encode: "encode" by default)."""
    if pooling_params is None:
        pooling_params = PoolingParams(task=task or "encode")
    params = list(pooling_params) if isinstance(pooling_params, (list, tuple)) else [pooling_params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} pooling params for {n} prompts")
    for p in params:
        if not isinstance(p, PoolingParams):
            raise ValueError(f"pooling_params must be PoolingParams, got {type(p).__name__}")
    return params if task is None else [replace(p, task=task) for p in params]
