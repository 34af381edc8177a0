"""The runner of an encode server (E/PD disaggregation, `mm_encoder_only`): it owns the towers' weights and the
encoder outputs (its EncoderRunner), no KV cache. Each step encodes the media items the scheduler released
(`EncoderRunner.run`, which publishes each new item through the encoder-cache connector) and samples nothing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vlserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.worker.cpu_allocator import tune_cpu_allocator
from vlserve.worker.encoder_runs import EncoderRunner


@dataclass
class EncodeRequestState:
    """What the encode runner keeps of a request between steps: its media items (and adapter: always None here)."""

    req_id: str
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    lora_request: Any = None


class EncoderOnlyRunner:
    """Runs the scheduled media items through the model's encoder parts (`embed_multimodal`); the model was loaded
    with `keep_encoder_parts`, so it has no decoder layers to run. Tensors: the weights and the encoder outputs
    (`encoders`: `[n, H]` by mm_hash, dropped when the scheduler's encoder cache evicts the entry)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.model = model
        if device.type == "cpu":
            tune_cpu_allocator()
        self.device, self.dtype = device, dtype
        self.requests: dict[str, EncodeRequestState] = {}
        # encoder outputs by mm_hash, the counters and the encoder-cache connector (an ec_producer's, set by the worker)
        self.encoders = EncoderRunner(model, device)
        self.kv_caches: list = []  # no KV cache: nothing is prefilled here
        self.kv_layers = range(0)
        self.forward = None  # no decoder forward (the worker reports 0 graph replays / eager forwards)
        self.lora_manager = None
        self.kv_connector = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """An encode server allocates no KV cache (`num_blocks` is 0)."""
        if num_blocks:
            raise ValueError(f"an encode server holds no KV cache, asked for {num_blocks} blocks")

    def warm_up_model(self, max_num_seqs: int, max_model_len: int) -> None:
        """Nothing to compile or capture: the towers run eager."""

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Encode the released items and publish them (an item already held is published again only if its file is
        gone); returns no tokens for every scheduled request."""
        t0 = time.perf_counter()
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        self.encoders.free(so.free_encoder_mm_hashes)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = EncodeRequestState(new.req_id, new.mm_features)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        encoded = self.encoders.run(so, self.requests)
        # items reused from the encoder cache too: their files normally exist (an existing file is kept)
        self.encoders.publish(feat for rid in so.num_scheduled_tokens for feat in self.requests[rid].mm_features)
        req_ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids])
        out.encoder_seconds, out.num_encoded_embeds = encoded.seconds, encoded.num_embeds
        out.step_seconds = time.perf_counter() - t0
        return out
