"""`LLM`'s pooling calls (vLLM's shapes): `encode`, `embed`, `classify` and `score`, for an engine started with
`runner="pooling"` (or a checkpoint that pools on its own)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from vlserve.engine.engine_loop import NewRequest
from vlserve.engine.input_processor import ProcessedPrompt
from vlserve.engine.scoring import is_dual_tower, plan_scores, process_score_prompt, scores_from_outputs
from vlserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
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
        data_1: Any,
        data_2: Any,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request=None,
    ) -> list[ScoringRequestOutput]:
        """Score query / document pairs: one query against many documents, or pairwise lists of equal length.
        Each side is a string, a list of strings, or vLLM's multimodal inputs (`{"content": [parts]}`, or a list
        mixing strings and such dicts); see `vlserve.engine.scoring`. A classifier scores each pair pooled together
        (two strings as the tokenizer's text pair, else one chat message: the query's parts then the document's);
        an embedder, the cosine of the two embeddings. `.outputs.score` per pair."""
        if isinstance(pooling_params, (list, tuple)):
            raise ValueError("score takes one PoolingParams for every pair")
        plan = plan_scores(data_1, data_2, self.engine.pooling_tasks)
        dual_tower = is_dual_tower(self.input_processor.loaded.hf_config)
        processed = [process_score_prompt(self.input_processor, p, dual_tower=dual_tower) for p in plan.prompts]
        params = _params_for(pooling_params, plan.task, len(processed))
        return scores_from_outputs(plan, self._run_pooling(processed, params, use_tqdm, lora_request))

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
