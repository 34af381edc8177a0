"""`LoRARequest`: which adapter a request runs with (vLLM's fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter to run a request with: `lora_name` (what the API calls it), `lora_int_id` (its id inside the
    engine, >= 1; 0 is "no adapter"), `lora_path` (a PEFT adapter directory: adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
