"""What a new request must meet before the scheduler queues it: the engine's limits (pure Python)."""

from __future__ import annotations

from vlserve.config import SchedulerConfig
from vlserve.core.request import EngineCoreRequest


class QueueFullError(ValueError):
    """The waiting queue is at max_waiting_requests (HTTP 503/429)."""


def check_request(cfg: SchedulerConfig, engine_req: EngineCoreRequest, max_kv_tokens: int, num_waiting: int) -> int:
    """Validate a request against the engine's limits (`max_kv_tokens`: what the KV cache holds for one request;
    `num_waiting`: the waiting queue's length); ValueError (QueueFullError for a full queue) says what to change.
    Returns its resolved max_tokens: the room left after the prompt, capped by the request's own."""
    n_prompt = len(engine_req.prompt_token_ids)
    if n_prompt == 0:
        raise ValueError("the prompt is empty; give at least one token")
    out = 0 if engine_req.pools else 1  # a pooling request needs no position for output
    if n_prompt + out > cfg.max_model_len:
        raise ValueError(
            f"the prompt has {n_prompt} tokens but max_model_len is {cfg.max_model_len}; shorten the prompt or "
            "raise max_model_len" + ("" if engine_req.pools else " (one position must stay free for output)")
        )
    if n_prompt + out > max_kv_tokens:
        raise ValueError(
            f"the prompt has {n_prompt} tokens but the KV cache holds only {max_kv_tokens}; "
            f"raise num_kv_blocks or kv_cache_memory_bytes"
        )
    for i, f in enumerate(engine_req.mm_features):  # the per-step budget never refuses: a big item runs alone
        if f.length > cfg.encoder_cache_size:
            raise ValueError(
                f"{f.modality} item {i} needs {f.length} embeddings, more than the encoder cache "
                f"budget of {cfg.encoder_cache_size}; shrink it (e.g. max_pixels) or raise "
                f"encoder_cache_size"
            )
        if cfg.disable_chunked_mm_input and f.length > cfg.max_num_batched_tokens:
            raise ValueError(
                f"{f.modality} item {i} has {f.length} placeholder tokens, more than "
                f"max_num_batched_tokens={cfg.max_num_batched_tokens}; this model needs a whole "
                f"item in one step: raise max_num_batched_tokens or shrink the item"
            )
    if engine_req.lora_request is not None and not cfg.max_loras:
        raise ValueError("this request names a LoRA adapter but the engine runs without LoRA (enable_lora)")
    if engine_req.priority and cfg.scheduling_policy != "priority":  # vLLM refuses it the same way
        raise ValueError(
            f"priority {engine_req.priority} was given but priority scheduling is off; start the engine with "
            f"scheduling_policy='priority' (--scheduling-policy priority) or leave priority out"
        )
    if cfg.max_waiting_requests is not None and num_waiting >= cfg.max_waiting_requests:
        raise QueueFullError(f"the waiting queue is full ({cfg.max_waiting_requests} requests)")
    params = engine_req.sampling_params
    room = min(cfg.max_model_len, max_kv_tokens) - n_prompt
    return room if params.max_tokens is None else min(params.max_tokens, room)
