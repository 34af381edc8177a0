"""LoRA adapters, laid out as vLLM's `vllm/lora`: PEFT adapters applied per token over the decoder.

- `request.LoRARequest(lora_name, lora_int_id, lora_path)`: which adapter a request runs with.
- `peft_checkpoint`: a PEFT adapter directory -> per-module A / B prepared for our fused layers (scaling folded).
- `layers`: LoRA-capable qkv_proj / o_proj / gate_up_proj / down_proj (in place, same parameters), the per-step
  context `lora_step(token_slots)` they read (as `kernels.attention_op.attention_step`).
- `kernels.lora_ref`: the torch twin of punica's shrink / expand (grouped by slot; per-token reference).
- `model_manager.LoRAModelManager`: wraps the layers once, host LRU of adapters, device slots, per-step slots.

The engine wiring. `EngineArgs(enable_lora, max_loras, max_lora_rank, max_cpu_loras, lora_modules)`;
`ModelRunner` builds `LoRAModelManager` after `pack_linears_for_cpu` and runs each step's decoder call under
`lora_manager.step([s.lora_request for s in states], q_lens)` (states in batch order). Requests carry their
LoRARequest EngineCoreRequest -> Request -> NewRequestData -> runner state; the scheduler caps a step's distinct
adapters at max_loras and block hashes carry "lora:<id>". Quick checks (files, config, rank) run when a request (or
the server) first names an adapter, so a bad one fails the request, not a step; a step that meets an adapter
evicted from the host LRU reloads it synchronously. LoRA engines run eager (no compile, no
CUDA graphs); spec-decode drafts (n-gram, EAGLE) come from the base model and the adapter model verifies them.
Tower LoRA: an adapter may also target the linears of a multimodal model's tower and projector; the runner
encodes its items in their own encoder run (`LoRAModelManager.encoder_step`) and the input processor keys their
mm_hash by the adapter, so the encoder cache never serves one adapter's embeddings to another.
Tensor parallel: A and B are sharded with their base layer (see peft_checkpoint); the encoder parts stay whole.
Loading: a new adapter's files are read on a background thread of each rank while steps go on (the engine core's
`engine/lora_loads.py` polls the ranks between steps; requests naming it wait in the scheduler's queue).
Not yet: async scheduling, graph-captured LoRA.
"""

from vlserve.lora.layers import current_lora_step, lora_step
from vlserve.lora.model_manager import LoRAModelManager
from vlserve.lora.peft_checkpoint import LoRAAdapter, PeftLoRAConfig, load_peft_adapter
from vlserve.lora.request import LoRARequest

__all__ = [
    "LoRAAdapter",
    "LoRAModelManager",
    "LoRARequest",
    "PeftLoRAConfig",
    "current_lora_step",
    "load_peft_adapter",
    "lora_step",
]
