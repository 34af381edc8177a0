"""Engine configuration: the user's knobs (EngineArgs) resolved against the checkpoint (VlserveConfig)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from vlserve.shorten import shorten


@dataclass(slots=True)
class SchedulerConfig:
    """Budgets the scheduler enforces every step."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    encoder_cache_size: int = 8192  # in embeddings
    encoder_compute_budget: int = 8192  # embeddings encoded per step
    num_spec_tokens: int = 0
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")


@dataclass
class EngineArgs:
    """Everything `LLM(...)` and `vlserve serve` accept (vLLM's names where the meaning is the same)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.25  # of available memory, when profiling decides the KV size
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str = "auto"
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    mm_processor_kwargs: dict[str, Any] | None = None
    encoder_cache_size: int | None = None
    max_waiting_requests: int | None = None
    speculative_config: dict[str, Any] | None = None
    served_model_name: str | None = None
    chat_template_content_format: str = "auto"  # "auto" | "string" | "openai": what the chat template's content is

    def __post_init__(self) -> None:
        if isinstance(self.limit_mm_per_prompt, str):
            self.limit_mm_per_prompt = json.loads(self.limit_mm_per_prompt)
        if isinstance(self.speculative_config, str):
            self.speculative_config = json.loads(self.speculative_config)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32"):
            raise ValueError(f"dtype must be one of auto/float32/bfloat16/float16, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be auto/string/openai, "
                             f"got {shorten(self.chat_template_content_format)}")
        if self.model is not None:
            self.model = os.path.expanduser(str(self.model))


def resolve_model_path(model: str | None) -> str:
    """A local checkpoint directory, checked for config.json (no hub downloads here). None means the embedded demo
    model; the names "vlserve-demo" and "vlserve-demo-audio" mean the shipped checkpoints (vlserve.demo) unless a
    local directory of that name exists."""
    from vlserve.demo import DEMO_MODELS, demo_model_path  # the embedded demo models

    if model is None:
        model = demo_model_path("vlserve-demo")
    elif model in DEMO_MODELS and not os.path.isdir(model):
        model = demo_model_path(model)
    if not os.path.isdir(model):
        raise ValueError(f"model path {model!r} is not a local directory; vlserve loads Hugging Face checkpoints "
                         f"from disk (config.json + *.safetensors + tokenizer files).")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json")
    return model
