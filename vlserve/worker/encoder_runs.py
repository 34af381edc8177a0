"""The encoder part of a step: the multimodal items the scheduler released are encoded and their embeddings cached
in the runner's `encoder_outputs` (mm_hash -> `[n, H]`), which the step's embedding merge reads. Items split over
several steps run a slice of their tower's stages per step (`run_encoder_slices`), their state between steps in
the runner's `partial_encodes` (mm_hash -> `vlserve.encoders.staged.TowerState`)."""
from __future__ import annotations

import contextlib
import time

import torch

from vlserve.core.sched_output import SchedulerOutput


def concat_mm_data(items: list[dict]) -> dict:
    """Processed data of several items of one modality -> one dict: tensors concatenated along dim 0 (pixel rows,
    grid rows, per-item scalars), lists joined, in item order. All items carry the same keys."""
    if len(items) == 1:
        return items[0]
    merged = {}
    for key in items[0]:
        values = [item[key] for item in items]
        if isinstance(values[0], torch.Tensor):
            merged[key] = torch.cat([v.reshape(1) if v.dim() == 0 else v for v in values], dim=0)
        else:
            merged[key] = [x for v in values for x in (v if isinstance(v, (list, tuple)) else [v])]
    return merged


def run_encoders(runner, so: SchedulerOutput) -> tuple[float, int]:
    """This step's encoder work: the whole items (`encode_whole_items`), then the slices of split ones
    (`run_encoder_slices`). Returns (wall seconds, embeddings' worth of work)."""
    seconds, num_embeds = encode_whole_items(runner, so)
    if so.scheduled_encoder_slices:
        slice_seconds, slice_embeds = run_encoder_slices(runner, so)
        seconds, num_embeds = seconds + slice_seconds, num_embeds + slice_embeds
    return seconds, num_embeds


def encode_whole_items(runner, so: SchedulerOutput) -> tuple[float, int]:
    """Encode every item the scheduler released this step that is not cached yet: one encoder call per
    modality (and per LoRA adapter with tower weights) over all of them (data concatenated in item order), the
    output split by each item's length. With an encoder-cache connector, an item a producer stored is loaded
    instead (a bad or missing file: encoded), and a producer stores what it encodes. Returns (wall seconds spent, device work included; embeddings
    produced)."""
    ec = runner.ec_connector  # the encoder-cache connector: its items load instead of encoding (base weights only)
    pending: dict[tuple[str, int], dict[str, object]] = {}  # (modality, adapter) -> {mm_hash: feature}
    adapters: dict[int, object] = {0: None}  # lora_int_id -> its LoRARequest (0: the base model)
    for rid, item_indices in so.scheduled_encoder_inputs.items():
        state = runner.requests[rid]
        lora = state.lora_request
        lora_id = lora.lora_int_id if lora is not None and runner.lora_manager.touches_encoder(lora) else 0
        adapters[lora_id] = lora if lora_id else None
        for i in item_indices:
            feat = state.mm_features[i]
            if feat.mm_hash in runner.encoder_outputs:
                continue
            if ec is not None and not lora_id and (loaded := ec.load(feat.mm_hash, feat.length)) is not None:
                runner.encoder_outputs[feat.mm_hash] = loaded  # [n, H] a producer encoded: the tower does not run
            else:
                pending.setdefault((feat.modality, lora_id), {}).setdefault(feat.mm_hash, feat)
    if not pending:
        return 0.0, 0
    t0 = time.perf_counter()
    num_embeds = 0
    for (modality, lora_id), by_hash in pending.items():
        feats = list(by_hash.values())
        lora = (contextlib.nullcontext() if not lora_id  # the adapter's tower / projector weights apply
                else runner.lora_manager.encoder_step(  # the step's other adapters keep their slots
                    adapters[lora_id], [runner.requests[r].lora_request for r in so.num_scheduled_tokens]))
        with lora:
            emb = runner.model.embed_multimodal(modality, concat_mm_data([f.data for f in feats]))  # [sum n, H]
        lengths = [f.length for f in feats]
        if emb.shape[0] != sum(lengths):
            raise RuntimeError(f"encoder produced {emb.shape[0]} {modality} embeddings for placeholder runs of "
                               f"{lengths} tokens ({[f.mm_hash for f in feats]})")
        for feat, item_emb in zip(feats, emb.split(lengths)):
            # own storage per entry, so dropping one cache entry frees its memory
            runner.encoder_outputs[feat.mm_hash] = item_emb.clone() if len(feats) > 1 else item_emb  # [n, H]
            if ec is not None and not lora_id:
                ec.save(feat.mm_hash, item_emb)  # a producer's: for the consumers sharing its directory
        _count_runs(runner, modality, len(feats))
        num_embeds += emb.shape[0]
    if runner.device.type == "cuda":
        torch.cuda.synchronize()  # the towers' kernels are queued, not done
    return time.perf_counter() - t0, num_embeds


def run_encoder_slices(runner, so: SchedulerOutput) -> tuple[float, int]:
    """Run the step's slices of split items: the first slice begins the item's tower state (patch embedding, rotary
    tables, attention segments), each runs its blocks, the last finishes it (merger) into `encoder_outputs` and
    drops the state. An item a producer stored (encoder-cache connector) loads at its first slice instead; its
    later slices then do nothing. Returns (wall seconds, embeddings' worth of work: length x share of stages)."""
    model, ec, partial = runner.model, runner.ec_connector, runner.partial_encodes
    t0 = time.perf_counter()
    work = 0.0
    for rid, slices in so.scheduled_encoder_slices.items():
        features = runner.requests[rid].mm_features
        for piece in slices:
            feat = features[piece.item_index]
            if feat.mm_hash in runner.encoder_outputs:
                continue  # loaded from a producer at its first slice
            if piece.start == 0:
                if ec is not None and (loaded := ec.load(feat.mm_hash, feat.length)) is not None:
                    runner.encoder_outputs[feat.mm_hash] = loaded  # [n, H]
                    continue
                partial[feat.mm_hash] = model.begin_encode_stages(feat.modality, feat.data)
            state = model.run_encode_stages(partial[feat.mm_hash], piece.start, piece.end)
            work += feat.length * (piece.end - piece.start) / piece.num_stages
            if piece.end < piece.num_stages:
                continue
            del partial[feat.mm_hash]
            emb = model.finish_encode_stages(state)  # [n, H]
            if emb.shape[0] != feat.length:
                raise RuntimeError(f"encoder produced {emb.shape[0]} {feat.modality} embeddings for a placeholder "
                                   f"run of {feat.length} tokens ({feat.mm_hash})")
            runner.encoder_outputs[feat.mm_hash] = emb
            if ec is not None:
                ec.save(feat.mm_hash, emb)
            _count_runs(runner, feat.modality, 1)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()  # the towers' kernels are queued, not done
    return time.perf_counter() - t0, max(1, round(work)) if work else 0


def _count_runs(runner, modality: str, n: int) -> None:
    """Count n items encoded by the tower (/metrics' encoder runs, in all and per modality)."""
    runner.num_encoder_runs += n
    runner.encoder_runs_by_modality[modality] = runner.encoder_runs_by_modality.get(modality, 0) + n
