"""`LoRAModelManager`: the LoRA layers of one model, the adapters in host memory and the device slots.

Built once per model (after loading, and after `pack_linears_for_cpu` or not: either order works): it turns the
decoder projections its `ModelCapabilities.lora_targets` name (qkv_proj / o_proj, and gate_up_proj / down_proj of
each dense GatedMLP) into their LoRA classes in place (`vlserve.lora.layers`). Adapters are parsed from PEFT
directories into a host LRU of up to `max_cpu_loras` (by `lora_int_id`); `max_loras` device slots hold the adapters
a step uses. Each step, `prepare_step(adapters per request, tokens per request)` gives every adapter of the step a
slot (loading it, evicting the least recently used slot no request of this step needs) and returns the per-token
slots, which `lora_step` makes what the layers read during the forward; `step(...)` is the two in one call.

Loading off the step loop: `start_loading(request)` reads the adapter's files on a background thread;
`finished_loads()` (called between steps) prepares the ones read and puts them in the host LRU, so only the cheap
part (slicing for this rank, folding the scaling) runs on the caller's thread. A step that needs an adapter not
held still loads it synchronously (waiting for its read when one is under way).

Tower LoRA: on a multimodal model (`ModelCapabilities.encoder_lora`) an adapter may also target the linears of the
vision / audio tower and the projector. Those linears become LoRA layers the first time an adapter names them (so
an engine whose adapters never do pays nothing there), and `encoder_step(adapter)` makes that adapter apply to
every row of an encoder run (the runner encodes each adapter's items apart; their embeddings are cached under
adapter-specific keys).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from vlserve.kernels.host_copy import to_device
from vlserve.lora.layers import (
    LoRALayerMixin,
    captured_lora_step,
    current_lora_step,
    lora_step,
    uniform_lora_step,
    unwrap,
    wrap_layer,
    wrap_mlp,
)
from vlserve.lora.peft_checkpoint import LoRAAdapter, load_peft_adapter, read_peft_files
from vlserve.lora.request import LoRARequest
from vlserve.models.capabilities import capabilities_of
from vlserve.models.layers import GatedMLP
from vlserve.models.llama import decoder_of

AdapterRef = LoRARequest | int | None  # per request: a request's adapter, a known lora_int_id, or None / 0 (base)


class LoRAModelManager:
    """LoRA for `model`'s decoder: `max_loras` device slots of rank up to `max_lora_rank`, an LRU of up to
    `max_cpu_loras` parsed adapters in host memory (default: max_loras)."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None = None,
    ) -> None:
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.model = model
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        caps = capabilities_of(model)
        if not caps.lora_targets:
            raise ValueError(f"{type(model).__name__} does not support LoRA adapters")
        self.encoder_lora = caps.encoder_lora
        decoder = decoder_of(model)
        if any(isinstance(m, LoRALayerMixin) for m in decoder.modules()):
            raise ValueError("this model's layers already belong to a LoRAModelManager")
        emb = decoder.embed_tokens.weight
        self.dtype, self.device = emb.dtype, emb.device
        self.targets: dict[str, LoRALayerMixin] = {}  # decoder-relative module name -> LoRA layer
        self._wrapped: list[nn.Module] = []
        wanted = set(caps.lora_targets)
        for i, layer in enumerate(decoder.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if "qkv_proj" in wanted:
                self._wrap(f"layers.{i}.self_attn.qkv_proj", attn.qkv_proj)
            if "o_proj" in wanted:
                self._wrap(f"layers.{i}.self_attn.o_proj", attn.o_proj, ("o_proj",))
            if type(mlp) is GatedMLP and wanted & {"gate_up_proj", "down_proj"}:  # MoE blocks: attention only
                self._wrapped.append(wrap_mlp(mlp))
                if "gate_up_proj" in wanted:
                    self._wrap(f"layers.{i}.mlp.gate_up_proj", mlp.gate_up_proj)
                if "down_proj" in wanted:
                    self._wrap(f"layers.{i}.mlp.down_proj", mlp.down_proj, ("down_proj",))
        self._adapters: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()  # host LRU, oldest first
        self._slots: list[int | None] = [None] * max_loras  # slot -> lora_int_id
        self._slot_lru: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self._reading: dict[int, tuple[LoRARequest, Future]] = {}  # adapters whose files a background thread reads
        self._reader: ThreadPoolExecutor | None = None

    def _wrap(self, name: str, module: nn.Module, pieces: tuple[str, ...] | None = None) -> None:
        self.targets[name] = wrap_layer(module, self.max_loras, self.max_lora_rank, self.dtype, self.device, pieces)
        self._wrapped.append(module)

    def unwrap_model(self) -> None:
        """Turn the model's layers back into their base classes (the manager is unusable afterwards)."""
        for module in self._wrapped:
            unwrap(module)
        self._wrapped, self.targets = [], {}
        self._adapters.clear()
        self._slot_lru.clear()
        self._reading.clear()
        if self._reader is not None:
            self._reader.shutdown(wait=False)

    # -- host adapters ----------------------------------------------------------------------------------------
    def add_adapter(self, request: LoRARequest) -> bool:
        """Parse `request.lora_path` into host memory (evicting the least recently used adapter, and its slot, when
        `max_cpu_loras` are held); False if its lora_int_id is held already (then only marked as used)."""
        if request.lora_int_id in self._adapters:
            self._adapters.move_to_end(request.lora_int_id)
            return False
        reading = self._reading.pop(request.lora_int_id, None)
        files = reading[1].result() if reading is not None else None  # its read's error, if any, is raised here
        self._hold(request, self._parse(request, files))
        return True

    def _parse(self, request: LoRARequest, files=None) -> LoRAAdapter:
        encoder_target = self._encoder_target if self.encoder_lora else None
        return load_peft_adapter(
            request.lora_path, self.targets, self.max_lora_rank, request.lora_int_id, encoder_target, files
        )

    def _hold(self, request: LoRARequest, adapter: LoRAAdapter) -> None:
        """Put a parsed adapter in the host LRU, evicting the least recently used ones past max_cpu_loras."""
        while len(self._adapters) >= self.max_cpu_loras:
            self.remove_adapter(next(iter(self._adapters)))
        self._adapters[request.lora_int_id] = (request, adapter)

    def start_loading(self, request: LoRARequest) -> bool:
        """Start reading the adapter's files on the background thread; False when it is held or being read."""
        if request.lora_int_id in self._adapters or request.lora_int_id in self._reading:
            return False
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="vlserve-lora-load")
        self._reading[request.lora_int_id] = (request, self._reader.submit(read_peft_files, request.lora_path))
        return True

    def finished_loads(self) -> dict[int, str | None]:
        """The background loads that ended since the last call: lora_int_id -> None (the adapter is now held) or
        the error that stopped it (missing files, a bad config, weights that do not fit the model)."""
        done: dict[int, str | None] = {}
        for lora_id, (request, fut) in list(self._reading.items()):
            if not fut.done():
                continue
            del self._reading[lora_id]
            try:
                self._hold(request, self._parse(request, fut.result()))
                done[lora_id] = None
            except Exception as e:  # the adapter's own error, reported to the requests that wait for it
                done[lora_id] = str(e)
        return done

    def _encoder_target(self, hf_module: str) -> tuple[str, LoRALayerMixin] | None:
        """A PEFT module name of the model's encoder parts -> (our linear's name, its LoRA layer, wrapped now if it
        was not yet), or None when the model has no such linear."""
        name = self.model.encoder_linear_name(hf_module)
        if name is None:
            return None
        if name not in self.targets:
            module = self.model.get_submodule(name)
            if getattr(module, "quant_scheme", None) is not None:
                raise ValueError(
                    f"the adapter targets the encoder linear {hf_module}, which is quantized "
                    f"({module.quant_scheme.describe()}): tower LoRA needs float towers (no mm_encoder_quantization)"
                )
            held = (module.packed_weight, module.weight, getattr(module, "onednn_weight", None))
            weight = next(w for w in held if w is not None)  # a tower's matrix may be held only prepacked (AMX)
            self.targets[name] = wrap_layer(
                module, self.max_loras, self.max_lora_rank, weight.dtype, weight.device, (name.rpartition(".")[2],)
            )
            self._wrapped.append(module)
        return name, self.targets[name]

    def touches_encoder(self, adapter: AdapterRef) -> bool:
        """Whether the adapter (loaded now if it is a LoRARequest not held) changes a tower or projector linear."""
        lora_id = self._id_of(adapter)
        return bool(lora_id) and bool(self._adapters[lora_id][1].encoder_modules)

    def encoder_step(self, adapter: AdapterRef, keep: Sequence[AdapterRef] = ()):
        """Context manager for one encoder run of `adapter`'s items: the tower / projector LoRA layers apply its
        slot to every row (nothing for the base or an adapter without encoder weights). `keep`: the step's other
        adapters, whose slots are not evicted to make room."""
        if not self.touches_encoder(adapter):
            return contextlib.nullcontext()
        lora_id = _ref_id(adapter)
        keep_ids = list(dict.fromkeys([lora_id] + [i for i in map(_ref_id, keep) if i]))
        return uniform_lora_step(self._activate(lora_id, keep_ids))

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Drop an adapter from host memory and its device slot (or forget its load under way); False if it was
        neither held nor loading."""
        if self._reading.pop(lora_int_id, None) is not None:
            return True
        if self._adapters.pop(lora_int_id, None) is None:
            return False
        slot = self._slot_lru.pop(lora_int_id, None)
        if slot is not None:
            self._slots[slot] = None
            for layer in self.targets.values():
                layer.reset_lora(slot)
        return True

    def list_adapters(self) -> dict[int, LoRARequest]:
        """The adapters in host memory: lora_int_id -> its LoRARequest (least recently used first)."""
        return {i: req for i, (req, _) in self._adapters.items()}

    def slot_of(self, lora_int_id: int) -> int | None:
        """The device slot holding the adapter, or None."""
        return self._slot_lru.get(lora_int_id)

    # -- per step ---------------------------------------------------------------------------------------------
    def prepare_step(self, adapters: Sequence[AdapterRef], num_tokens: Sequence[int] | None = None) -> torch.Tensor:
        """`_prepare_step`'s token slots alone (see there)."""
        return self._prepare_step(adapters, num_tokens)[0]

    def _prepare_step(
        self, adapters: Sequence[AdapterRef], num_tokens: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Slots for one step. `adapters[i]`: request i's LoRARequest (added if not held), a held lora_int_id, or
        None / 0 for the base model, in batch order; `num_tokens[i]`: its scheduled tokens (None: `adapters` is
        per token). Returns `token_slots [T]` int64 on the model's device (-1: base) and the distinct slots it
        uses (known on the host). ValueError when the step uses more than max_loras distinct adapters or an
        unknown id."""
        ids = [_ref_id(a) for a in adapters]
        distinct = list(dict.fromkeys(i for i in ids if i))
        if len(distinct) > self.max_loras:
            raise ValueError(
                f"a step uses {len(distinct)} distinct LoRA adapters, more than max_loras ({self.max_loras})"
            )
        for i in distinct:  # touch the held ones first, so loading the others evicts none of this step's
            if i in self._adapters:
                self._adapters.move_to_end(i)
        for a in adapters:
            self._id_of(a)  # loads a LoRARequest not held; an unknown bare id is a ValueError
        slot_of = {i: self._activate(i, distinct) for i in distinct}
        slots = torch.tensor([slot_of.get(i, -1) for i in ids], dtype=torch.int64)  # [B] or [T]
        if num_tokens is not None:
            if len(num_tokens) != len(ids):
                raise ValueError(f"{len(ids)} adapters for {len(num_tokens)} requests")
            slots = slots.repeat_interleave(torch.as_tensor(num_tokens, dtype=torch.int64))  # [T]
        return to_device(slots, self.device), tuple(sorted(slot_of.values()))

    def lora_step(self, token_slots: torch.Tensor):
        """Context manager: the LoRA layers apply `token_slots [T]` during the block (see `layers.lora_step`)."""
        return lora_step(token_slots)

    def step(self, adapters: Sequence[AdapterRef], num_tokens: Sequence[int] | None = None):
        """`prepare_step` + `lora_step` in one call: the runner's seam. A step without adapters sets no context
        (the layers run as their base, adding nothing)."""
        if not any(_ref_id(a) for a in adapters):
            return contextlib.nullcontext()
        return lora_step(*self._prepare_step(adapters, num_tokens))

    # -- CUDA graphs ------------------------------------------------------------------------------------------
    def enable_graph_slots(self, max_tokens: int) -> None:
        """Allocate the persistent slot buffer decode graphs read (`graph_slots [max_tokens]` int64, -1 = base)."""
        self.graph_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=self.device)

    def graph_step(self, num_tokens: int):
        """Context manager a decode graph of `num_tokens` rows is captured under (see `layers.captured_lora_step`)."""
        return captured_lora_step(self.graph_slots[:num_tokens])

    def load_graph_slots(self, num_rows: int, bucket: int) -> None:
        """Before a replay: the current step's slots (`step(...)`'s, one per row; none: base) into the buffer's
        first `num_rows`, -1 on the padding rows up to `bucket`."""
        step = current_lora_step()
        if step is None or step.token_slots is None:
            self.graph_slots[:bucket].fill_(-1)
            return
        self.graph_slots[:num_rows].copy_(step.token_slots, non_blocking=True)
        self.graph_slots[num_rows:bucket].fill_(-1)

    def _id_of(self, ref: AdapterRef) -> int:
        if ref is None:
            return 0
        if isinstance(ref, LoRARequest):
            if ref.lora_int_id not in self._adapters:
                self.add_adapter(ref)
            return ref.lora_int_id
        if ref and ref not in self._adapters:
            raise ValueError(f"LoRA adapter id {ref} is not loaded (add_adapter first)")
        return int(ref)

    def _activate(self, lora_int_id: int, keep: list[int]) -> int:
        """The slot of a host adapter, loading it into a free slot or the least recently used one not in `keep`."""
        slot = self._slot_lru.get(lora_int_id)
        if slot is not None:
            self._slot_lru.move_to_end(lora_int_id)
            return slot
        if None in self._slots:
            slot = self._slots.index(None)
        else:
            victim = next(i for i in self._slot_lru if i not in keep)  # exists: len(keep) <= max_loras
            slot = self._slot_lru.pop(victim)
        _, adapter = self._adapters[lora_int_id]
        by_module: dict[str, dict] = {}
        for (module, piece), w in adapter.weights.items():
            by_module.setdefault(module, {})[piece] = w
        for name, layer in self.targets.items():
            layer.set_lora(slot, by_module.get(name, {}))
        self._slots[slot] = lora_int_id
        self._slot_lru[lora_int_id] = slot
        return slot


def _ref_id(ref: AdapterRef) -> int:
    """The lora_int_id a reference names (0: base), loading nothing."""
    if ref is None:
        return 0
    return ref.lora_int_id if isinstance(ref, LoRARequest) else int(ref)
