"""A miniature "runner" driving a model over a paged KV cache, for model tests (also in spawned rank processes).

`PagedRunner` plays the model runner: it owns per-layer KV caches `[NB, BS, Hkv, D]` (this tensor-parallel rank's
KV heads), hands out blocks in a scrambled order (so block tables are not contiguous), builds `AttentionMetadata`
with decodes first, and returns per-sequence logits for every new token. With a `lora_manager`
(vlserve.lora.LoRAModelManager) each step runs under `lora_manager.step(...)` with the sequences' adapters, the
call the engine's runner makes.
"""

from __future__ import annotations

import contextlib
import random

import torch

from vlserve.kernels.metadata import AttentionMetadata
from vlserve.models import kv_cache_spec


class PagedRunner:
    """Drives `model` step by step over a paged KV cache, the way the engine's runner will."""

    def __init__(
        self,
        model,
        hf_config,
        block_size: int = 4,
        num_blocks: int = 128,
        dtype=torch.float32,
        device="cpu",
        seed: int = 0,
        forward=None,
        lora_manager=None,
    ) -> None:
        self.lora_manager = lora_manager
        self.model, self.block_size, self.device = model, block_size, torch.device(device)
        # the decoder call: the model itself, or e.g. a vlserve.worker.compiled_forward.ModelForward around it
        self.forward = forward if forward is not None else model
        num_layers, num_kv_heads, head_dim = kv_cache_spec(hf_config)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(
        self,
        items: list[tuple[str, list[int]]],
        positions: dict[str, torch.Tensor] | None = None,
        inputs_embeds: dict[str, torch.Tensor] | None = None,
        adapters: dict[str, object] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run one flattened step; items = [(seq_id, new token ids)], decodes are moved first.

        `positions[seq_id]` may override the default positions (e.g. `[3, q]` M-RoPE ids); `inputs_embeds[seq_id]`
        `[q, H]` replaces the token embeddings; `adapters[seq_id]` is its LoRARequest or lora_int_id (needs a
        `lora_manager`; absent = base). Returns {seq_id: logits [q, V] float32}.
        """
        items = sorted(items, key=lambda it: not (len(it[1]) == 1 and self.lens.get(it[0], 0) > 0))
        num_decodes = sum(1 for sid, toks in items if len(toks) == 1 and self.lens.get(sid, 0) > 0)
        ids, pos_list, slots, qsl, seq_lens, tables, embeds = [], [], [], [0], [], [], []
        for sid, toks in items:
            start = self.lens.get(sid, 0)
            end = start + len(toks)
            blocks = self.blocks.setdefault(sid, [])
            while len(blocks) * self.block_size < end:
                blocks.append(self.free.pop())
            self.lens[sid] = end
            ids += toks
            p = torch.arange(start, end)
            if positions is not None and sid in positions:
                pos_list.append(positions[sid])
            else:
                pos_list.append(p)
            slots += [blocks[i // self.block_size] * self.block_size + i % self.block_size for i in range(start, end)]
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            tables.append(blocks)
            if inputs_embeds is not None:
                embeds.append(
                    inputs_embeds[sid]
                    if sid in inputs_embeds
                    else self.model.get_input_embeddings(torch.tensor(toks, device=self.device))
                )
        width = max(len(t) for t in tables)
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            num_decodes=num_decodes,
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        pos = torch.cat(pos_list, dim=-1).to(dev)
        lora = contextlib.nullcontext()
        if self.lora_manager is not None:
            lora = self.lora_manager.step([(adapters or {}).get(sid) for sid, _ in items], [len(t) for _, t in items])
        with torch.inference_mode(), lora:
            if inputs_embeds is not None:
                hidden = self.forward(None, pos, self.kv_caches, md, inputs_embeds=torch.cat(embeds))
            else:
                hidden = self.forward(torch.tensor(ids, device=dev), pos, self.kv_caches, md)
            logits = self.model.compute_logits(hidden)
        return {sid: logits[a:b] for (sid, _), a, b in zip(items, qsl, qsl[1:])}
