"""LoRA adapters (issue 38), laid out as vLLM's `vllm/lora`: PEFT adapters applied per token over the decoder.

- `request.LoRARequest(lora_name, lora_int_id, lora_path)`: which adapter a request runs with.
- `peft_checkpoint`: a PEFT adapter directory -> per-module A / B prepared for our fused layers (scaling folded).
- `layers`: LoRA-capable qkv_proj / o_proj / gate_up_proj / down_proj (in place, same parameters), the per-step
  context `lora_step(token_slots)` they read (as `kernels.attention_op.attention_step`).
- `punica_ref`: the torch twin of punica's shrink / expand (grouped by slot; per-token reference).
- `model_manager.LoRAModelManager`: wraps the layers once, host LRU of adapters, device slots, per-step slots.

The runner seam (not wired yet). `ModelRunner.__init__`, after `pack_linears_for_cpu(model)`, when LoRA is on:

    self.lora_manager = LoRAModelManager(model, max_loras, max_lora_rank, max_cpu_loras)

`execute_model`, one call per step around the decoder call, with `states` in batch order (decodes first, as the
runner orders them), each request's `lora_request` (from its NewRequestData; None = base) and `q_lens` its
scheduled tokens:

    with self.lora_manager.step([s.lora_request for s in states], q_lens):
        hidden = self.forward(input_ids, positions, self.kv_caches, md, inputs_embeds=inputs_embeds)

A step with no adapter sets no context (the layers add nothing). Still to do around it: the scheduler caps the
distinct adapters of a step at max_loras; prefix-cache block hashes include lora_int_id; compiled / CUDA-graph
forwards run LoRA steps eager (`self.forward.eager()`) until the slots become graph inputs; spec-decode drafts
run without the adapter.
"""
from vlserve.lora.layers import current_lora_step, lora_step
from vlserve.lora.model_manager import LoRAModelManager
from vlserve.lora.peft_checkpoint import LoRAAdapter, PeftLoRAConfig, load_peft_adapter
from vlserve.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRAModelManager", "LoRARequest", "PeftLoRAConfig", "current_lora_step",
           "load_peft_adapter", "lora_step"]
