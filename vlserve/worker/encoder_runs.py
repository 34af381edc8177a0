"""The encoder part of a step (`EncoderRunner`): the multimodal items the scheduler released are encoded and their
embeddings kept by mm_hash (`[n, H]`) until the scheduler frees them; the step's embedding merge writes them over the
placeholder tokens. Items split over several steps run a slice of their tower's stages per step, their state between
steps kept by mm_hash (`vlserve.encoders.staged.TowerState`). A video marked for pruning (video_pruning.py) keeps
only its retained rows, and the runner holds their grid indices (`kept_indices`) for its M-RoPE positions. With
`split_across_ranks` (tensor parallel, `mm_encoder_tp_mode="data"`) the whole items of a step are divided among the
ranks (`worker/encoder_split.py`); slices of split items, and a call's lone item, still run on every rank."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from vlserve.core.sched_output import SchedulerOutput
from vlserve.distributed.communication import tp_all_gather
from vlserve.multimodal.embeds import merge_mm_embeds, slice_mm_embeds
from vlserve.multimodal.video_pruning import prune_video_embeds, pruning_rate, tower_data, tower_length
from vlserve.worker.encoder_split import encode_across_ranks


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


@dataclass(frozen=True)
class EncoderWork:
    """One step's encoder work: wall seconds (device work included) and embeddings' worth of it."""

    seconds: float = 0.0
    num_embeds: int = 0


NO_ENCODER_WORK = EncoderWork()


@dataclass
class EncoderCounters:
    """What the encoders did and hold, for the worker's stats (/metrics)."""

    num_runs: int = 0  # items the towers encoded (by the whole tensor-parallel group)
    runs_by_modality: dict[str, int] = field(default_factory=dict)
    num_partial: int = 0  # items held part-encoded (split over steps)
    ec_counters: dict[str, int] = field(default_factory=dict)  # the encoder-cache connector's (ec_*_total)
    num_local_runs: int = 0  # items this rank's tower encoded (num_runs unless split_across_ranks)


class EncoderRunner:
    """Runs the items the scheduler releases through the model's towers and owns what they produce: embeddings by
    mm_hash, the tower states of items split over steps, the run counters. `ec_connector`: the encoder-cache
    connector (distributed/ec_transfer) whose stored items load instead of encoding, or None. `split_across_ranks`:
    each tensor-parallel rank encodes its share of a step's whole items and the embeddings are all-gathered (every
    rank runs the same steps; the worker sets it for `mm_encoder_tp_mode="data"` above one rank). The requests (by
    id: their `mm_features` and `lora_request`) are the runner's, passed to `run`."""

    def __init__(self, model: torch.nn.Module, device: torch.device, lora_manager=None):
        self.model, self.device, self.lora_manager = model, device, lora_manager
        self.ec_connector = None
        self.split_across_ranks = False
        self._outputs: dict[str, torch.Tensor] = {}  # mm_hash -> [n, H]
        self._partial: dict[str, object] = {}  # mm_hash -> TowerState of an item split over steps
        self._kept: dict[str, torch.Tensor] = {}  # mm_hash -> int64 [n] grid indices of a pruned video's rows
        self._num_runs = 0
        self._num_local_runs = 0
        self._runs_by_modality: dict[str, int] = {}

    # -- the step's encoder work -------------------------------------------------------------------------------
    def run(self, so: SchedulerOutput, requests: Mapping) -> EncoderWork:
        """This step's encoder work: the whole items, then the slices of split ones."""
        if not so.scheduled_encoder_inputs and not so.scheduled_encoder_slices:
            return NO_ENCODER_WORK
        seconds, num_embeds = self._encode_whole_items(so, requests)
        if so.scheduled_encoder_slices:
            slice_seconds, slice_embeds = self._run_slices(so, requests)
            seconds, num_embeds = seconds + slice_seconds, num_embeds + slice_embeds
        return EncoderWork(seconds, num_embeds)

    def _encode_whole_items(self, so: SchedulerOutput, requests: Mapping) -> tuple[float, int]:
        """Encode every item the scheduler released this step that is not cached yet: one encoder call per
        modality (and per LoRA adapter with tower weights) over all of them (data concatenated in item order), the
        output split by each item's length (with `split_across_ranks`, one call per rank over its share). With an
        encoder-cache connector, an item a producer stored is loaded instead (a bad or missing file: encoded), and a
        producer stores what it encodes. Returns (wall seconds spent,
        device work included; embeddings produced)."""
        ec, outputs = self.ec_connector, self._outputs  # (connector items load instead of encoding: base weights)
        pending: dict[tuple[str, int], dict[str, object]] = {}  # (modality, adapter) -> {mm_hash: feature}
        adapters: dict[int, object] = {0: None}  # lora_int_id -> its LoRARequest (0: the base model)
        loads: dict[str, tuple[object, torch.Tensor | None]] = {}  # mm_hash -> (feature, what the connector gave)
        for rid, item_indices in so.scheduled_encoder_inputs.items():
            state = requests[rid]
            lora = state.lora_request
            lora_id = lora.lora_int_id if lora is not None and self.lora_manager.touches_encoder(lora) else 0
            adapters[lora_id] = lora if lora_id else None
            for i in item_indices:
                feat = state.mm_features[i]
                if feat.mm_hash in outputs:
                    continue
                if "image_embeds" in feat.data:  # precomputed by the client: what the tower would give
                    outputs[feat.mm_hash] = feat.data["image_embeds"].to(self.device)  # [n, H]
                    continue
                pruned = pruning_rate(feat.data) > 0  # (the connector keeps no grid indices: encoded here)
                if ec is not None and not lora_id and not pruned:
                    if feat.mm_hash not in loads:  # [n, H] a producer encoded, or None
                        loads[feat.mm_hash] = (feat, ec.load(feat.mm_hash, feat.length))
                else:
                    pending.setdefault((feat.modality, lora_id), {}).setdefault(feat.mm_hash, feat)
        for feat, loaded in self._agreed_loads(list(loads.values())):
            if loaded is not None:
                outputs[feat.mm_hash] = loaded  # the tower does not run
            else:
                pending.setdefault((feat.modality, 0), {}).setdefault(feat.mm_hash, feat)
        if not pending:
            return 0.0, 0
        t0 = time.perf_counter()
        num_embeds = 0
        for (modality, lora_id), by_hash in pending.items():
            feats = list(by_hash.values())
            lora = (
                contextlib.nullcontext()
                if not lora_id  # the adapter's tower / projector weights apply
                else self.lora_manager.encoder_step(  # the step's other adapters keep their slots
                    adapters[lora_id], [requests[r].lora_request for r in so.num_scheduled_tokens]
                )
            )
            with lora:
                item_embs = self._encode_items(modality, feats)  # the tower's rows per item, in order
            for feat, item_emb in zip(feats, item_embs):
                item_emb = self._pruned(feat, item_emb)
                # own storage per entry, so dropping one cache entry frees its memory
                outputs[feat.mm_hash] = item_emb.clone() if len(feats) > 1 else item_emb
                if ec is not None and not lora_id:
                    ec.save(feat.mm_hash, item_emb)  # a producer's: for the consumers sharing its directory
            self._count_runs(modality, len(feats))
            num_embeds += sum(tower_length(f.data, f.length) for f in feats)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the towers' kernels are queued, not done
        return time.perf_counter() - t0, num_embeds

    def _encode_items(self, modality: str, feats: list) -> list[torch.Tensor]:
        """Run the tower on these items of one modality -> each one's tower rows `[tower length, H]` (a pruned video's
        before pruning), in order: one call over all of them, or (`split_across_ranks`, several items) one call per
        rank over its share, gathered; a lone item is encoded on every rank (as fast as on one, and no gather)."""
        lengths = [tower_length(f.data, f.length) for f in feats]

        def encode(indices: list[int]) -> torch.Tensor:  # [sum of their lengths, H]
            self._num_local_runs += len(indices)
            return self.model.embed_multimodal(modality, concat_mm_data([tower_data(feats[i].data) for i in indices]))

        if self.split_across_ranks and len(feats) > 1:
            return encode_across_ranks(encode, lengths, self.device)
        emb = encode(list(range(len(feats))))  # [sum n, H]
        if emb.shape[0] != sum(lengths):
            raise RuntimeError(
                f"encoder produced {emb.shape[0]} {modality} embeddings for placeholder runs of "
                f"{lengths} tokens ({[f.mm_hash for f in feats]})"
            )
        return list(emb.split(lengths))

    def _agreed_loads(self, loads: list[tuple[object, torch.Tensor | None]]) -> list[tuple[object, object]]:
        """The connector's loads as every rank sees them: with `split_across_ranks` an item counts as loaded only
        where every rank found it (one gather of a flag per item), so all ranks encode the same items; else as
        given."""
        if not loads or not self.split_across_ranks:
            return loads
        found = torch.tensor([[loaded is not None for _, loaded in loads]], dtype=torch.int32, device=self.device)
        everywhere = tp_all_gather(found, dim=0).min(dim=0).values.tolist()  # [n]: 1 where every rank loaded it
        return [(feat, loaded if ok else None) for (feat, loaded), ok in zip(loads, everywhere)]

    def _run_slices(self, so: SchedulerOutput, requests: Mapping) -> tuple[float, int]:
        """Run the step's slices of split items: the first slice begins the item's tower state (patch embedding,
        rotary tables, attention segments), each runs its blocks, the last finishes it (merger) into the outputs
        and drops the state. An item a producer stored (encoder-cache connector) loads at its first slice instead;
        its later slices then do nothing. Returns (wall seconds, embeddings' worth of work: length x share of
        stages)."""
        model, ec, partial, outputs = self.model, self.ec_connector, self._partial, self._outputs
        t0 = time.perf_counter()
        work = 0.0
        for rid, slices in so.scheduled_encoder_slices.items():
            features = requests[rid].mm_features
            for piece in slices:
                feat = features[piece.item_index]
                if feat.mm_hash in outputs:
                    continue  # loaded from a producer at its first slice
                if piece.start == 0:
                    if "image_embeds" in feat.data:  # precomputed: no stage runs
                        outputs[feat.mm_hash] = feat.data["image_embeds"].to(self.device)  # [n, H]
                        continue
                    pruned = pruning_rate(feat.data) > 0
                    if ec is not None and not pruned and (loaded := ec.load(feat.mm_hash, feat.length)) is not None:
                        outputs[feat.mm_hash] = loaded  # [n, H]
                        continue
                    partial[feat.mm_hash] = model.begin_encode_stages(feat.modality, tower_data(feat.data))
                state = model.run_encode_stages(partial[feat.mm_hash], piece.start, piece.end)
                work += feat.length * (piece.end - piece.start) / piece.num_stages
                if piece.end < piece.num_stages:
                    continue
                del partial[feat.mm_hash]
                emb = self._pruned(feat, model.finish_encode_stages(state))  # [n, H]
                if emb.shape[0] != feat.length:
                    raise RuntimeError(
                        f"encoder produced {emb.shape[0]} {feat.modality} embeddings for a "
                        f"placeholder run of {feat.length} tokens ({feat.mm_hash})"
                    )
                outputs[feat.mm_hash] = emb
                if ec is not None:
                    ec.save(feat.mm_hash, emb)
                self._count_runs(feat.modality, 1)
                self._num_local_runs += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the towers' kernels are queued, not done
        return time.perf_counter() - t0, max(1, round(work)) if work else 0

    def _pruned(self, feat, emb: torch.Tensor) -> torch.Tensor:
        """A video marked for pruning: its retained rows `[length, W]` of the tower's `[t*h*w, W]`, their grid indices
        kept for its positions; any other item: `emb` as it is. The mask compares the main embedding only (the
        model's hidden size; Qwen3-VL's DeepStack levels past it go with their token)."""
        if not pruning_rate(feat.data):
            return emb
        width = self.model.text_config.hidden_size
        kept_rows, self._kept[feat.mm_hash] = prune_video_embeds(emb, feat.data, width)
        return kept_rows

    def kept_indices(self, mm_hash: str) -> torch.Tensor | None:
        """The grid indices (int64 `[n]`, on the CPU) of a held pruned video's rows, or None."""
        return self._kept.get(mm_hash)

    def _count_runs(self, modality: str, n: int) -> None:
        """Count n items encoded by the tower (/metrics' encoder runs, in all and per modality)."""
        self._num_runs += n
        self._runs_by_modality[modality] = self._runs_by_modality.get(modality, 0) + n

    # -- what it holds -----------------------------------------------------------------------------------------
    def merge_embeddings(
        self, input_ids: torch.Tensor, states, starts, q_lens, cu, skip_missing: bool = False
    ) -> torch.Tensor | None:
        """inputs_embeds [T, H] (the model's token embeddings of input_ids [T]) with the held embeddings written over
        placeholder tokens, or None when no row has media. Row cu[i] + j holds position starts[i] + j of states[i];
        skip_missing leaves token embeddings where an item is not held (the EAGLE draft's shifted window may reach
        one token into the next, unscheduled item)."""
        pieces = []  # (batch row, embeddings slice [n, H])
        for i in [i for i, state in enumerate(states) if state.mm_features]:  # (most rows of most steps: none)
            s, n = int(starts[i]), int(q_lens[i])
            pieces += slice_mm_embeds(states[i].mm_features, self._outputs, s, s + n, int(cu[i]), skip_missing)
        if not pieces:
            return None
        return merge_mm_embeds(self.model.get_input_embeddings(input_ids), pieces)  # [T, H]

    def lookup(self, mm_hash: str) -> torch.Tensor | None:
        """The held embeddings `[n, H]` of an item, or None."""
        return self._outputs.get(mm_hash)

    def partial_hashes(self) -> list[str]:
        """The items held part-encoded (a slice of their tower's stages run, not the last)."""
        return list(self._partial)

    def free(self, mm_hashes: Iterable[str]) -> None:
        """Drop what is held of these items (the scheduler's encoder cache evicted them, or abandoned them
        mid-encode)."""
        for h in mm_hashes:
            self._outputs.pop(h, None)
            self._partial.pop(h, None)
            self._kept.pop(h, None)

    def publish(self, features) -> None:
        """Store the held embeddings of these items through the encoder-cache connector (an existing file is kept;
        without a connector, nothing)."""
        if self.ec_connector is None:
            return
        for feat in features:
            emb = self._outputs.get(feat.mm_hash)  # [n, H]
            if emb is not None:
                self.ec_connector.save(feat.mm_hash, emb)

    def counters(self) -> EncoderCounters:
        """The run counters, the items held part-encoded and the connector's counters, now (copies)."""
        return EncoderCounters(
            self._num_runs,
            dict(self._runs_by_modality),
            len(self._partial),
            {} if self.ec_connector is None else dict(self.ec_connector.counters),
            self._num_local_runs,
        )
