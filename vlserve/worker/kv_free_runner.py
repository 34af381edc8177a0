"""The pooling runner of a KV-free model (`ModelCapabilities.kv_free`: no decoder, no KV cache; BERT-style
encoders, the CLIP / SigLIP dual towers). The scheduler runs its requests as any pooling prefill (chunked too); the
runner keeps each request's whole prompt and, in the step its window reaches the prompt's end, computes its result
in one call: every text prompt that ends this step in one `model.pool_prompts(token_ids, spec)` batch, and a
prompt made of one media item's placeholder (a dual tower's image) as that item's encoder output, which the encoder
path computed and the encoder cache holds by mm_hash (the same image twice runs the tower once).

The KV cache is bookkeeping only: the scheduler still hands out block ids (they bound how many prompts run at
once), but no tensor backs them (`bytes_per_block() == 0`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vlserve.core.kv_cache_manager import cdiv
from vlserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from vlserve.kernels.packed_linear import pack_linears_for_cpu
from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.pooling_params import PoolerSpec
from vlserve.worker.cpu_allocator import tune_cpu_allocator
from vlserve.worker.encoder_runs import EncoderRunner


@dataclass
class KvFreeRequestState:
    """What the runner keeps of a request until it ends: its whole prompt, how much of it is computed, its media
    item (a dual tower's image request has exactly one, over its whole prompt)."""

    req_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    lora_request: Any = None  # (the encoder path reads it; always None here)


class KvFreeRunner:
    """Runs one step of a KV-free pooling engine: the released media items through the encoder path, then the
    results of the prompts that end this step (`pooler_output`); nothing is sampled."""

    def __init__(
        self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, block_size: int, spec: PoolerSpec
    ):
        self.model, self.device, self.dtype, self.block_size, self.spec = model, device, dtype, block_size, spec
        if device.type == "cpu":  # the towers / encoder layers through the packed CPU kernels, many rows a call
            tune_cpu_allocator()
            pack_linears_for_cpu(model, many_rows=model.encoder_parts())
        self.requests: dict[str, KvFreeRequestState] = {}
        self.encoders = EncoderRunner(model, device)  # encoder outputs by mm_hash, counters
        self.kv_caches: list = []  # no KV tensors
        self.kv_layers = range(0)
        self.forward = None  # no decoder forward (the worker reports 0 graph replays / eager forwards)
        self.lora_manager = None
        self.kv_connector = None
        self.defer_readback = False
        self.num_pool_calls = 0  # `pool_prompts` calls (one per step that ends text prompts)

    # -- the KV cache: block ids only ----------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        """0: no tensor backs a block."""
        return 0

    def num_blocks(self, num_kv_blocks: int | None, max_num_seqs: int, max_model_len: int) -> int:
        """Block ids for the scheduler: `num_kv_blocks` if given, else enough for max_num_seqs prompts of
        max_model_len tokens (plus the null block); they cost no memory."""
        return num_kv_blocks or max_num_seqs * cdiv(max_model_len, self.block_size) + 1

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Nothing to allocate."""

    def warm_up_model(self, max_num_seqs: int, max_model_len: int) -> None:
        """Nothing to compile or capture: the model runs eager."""

    # -- one step ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Encode the released items, then pool every prompt whose window reaches its end this step."""
        t0 = time.perf_counter()
        self._update_states(so)
        encoded = self.encoders.run(so, self.requests)
        req_ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids])
        ending = [
            self.requests[rid]
            for rid, n in so.num_scheduled_tokens.items()
            if self.requests[rid].num_computed_tokens + n >= len(self.requests[rid].prompt_token_ids)
        ]
        out.pooler_output = self._pool(ending)
        out.encoder_seconds, out.num_encoded_embeds = encoded.seconds, encoded.num_embeds
        out.step_seconds = time.perf_counter() - t0
        return out

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        if so.free_encoder_mm_hashes:
            self.encoders.free(so.free_encoder_mm_hashes)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = KvFreeRequestState(
                new.req_id, list(new.prompt_token_ids), new.num_computed_tokens, list(new.mm_features)
            )
        cached = so.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.requests[rid].num_computed_tokens = computed

    def _pool(self, ending: list[KvFreeRequestState]) -> dict[str, torch.Tensor]:
        """The results of the prompts that end: float32 CPU tensors `[D]` (or `[num_labels]`), each its own
        storage. Text prompts go to the model in one `pool_prompts` call; an item's prompt is its encoder output."""
        results: dict[str, torch.Tensor] = {}
        texts = [state for state in ending if not state.mm_features]
        if texts:
            ids = [torch.tensor(state.prompt_token_ids, dtype=torch.long) for state in texts]  # [T_i] each
            pooled = self.model.pool_prompts(ids, self.spec).float().cpu()  # [N, D]
            self.num_pool_calls += 1
            results.update({state.req_id: pooled[k].clone() for k, state in enumerate(texts)})
        for state in ending:
            if not state.mm_features:
                continue
            if len(state.mm_features) != 1 or state.mm_features[0].length != len(state.prompt_token_ids):
                raise RuntimeError(f"request {state.req_id}: a KV-free prompt with media must be one item's span")
            embeds = self.encoders.lookup(state.mm_features[0].mm_hash)  # [1, D]
            if embeds is None:
                raise RuntimeError(f"request {state.req_id}: its item's encoder output is not held")
            results[state.req_id] = embeds[0].float().cpu().clone()  # [D]
        return results
