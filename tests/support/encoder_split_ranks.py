"""Rank-side functions of the data-parallel encoding tests (`vlserve.worker.encoder_split`), run in every rank of a
spawned CPU group by `tests.support.tensor_parallel.run_tensor_parallel`."""

from __future__ import annotations

import torch

from vlserve.distributed.parallel_state import tp_rank
from vlserve.worker.encoder_runs import concat_mm_data
from vlserve.worker.encoder_split import encode_across_ranks


def synthetic_item(index: int, length: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Item `index`'s stand-in embeddings `[length, width]`: every value tells item, row and column apart."""
    rows = torch.arange(length * width, dtype=torch.float64).reshape(length, width)
    return (rows + 1000 * (index + 1)).to(dtype)


def gather_synthetic_items(lengths: list[int], width: int, dtype_name: str) -> dict:
    """Encode stand-in items split over the group: {"items": every item's gathered rows in item order, "mine":
    the indices this rank encoded (None when it was given none)}."""
    dtype = getattr(torch, dtype_name)
    mine: list[list[int]] = []

    def encode(indices: list[int]) -> torch.Tensor:
        mine.append(list(indices))
        return torch.cat([synthetic_item(i, lengths[i], width, dtype) for i in indices])

    items = encode_across_ranks(encode, lengths, torch.device("cpu"))
    return {"items": [t.clone() for t in items], "mine": mine[0] if mine else None, "rank": tp_rank()}


def qwen2_vl_image_items(hf_config, grids: list[tuple[int, int, int]], seed: int = 0) -> list[dict]:
    """Processed image items of these (t, h, w) patch grids with random pixels, as the HF processor lays them out."""
    vision = hf_config.vision_config
    row = getattr(vision, "in_channels", 3) * vision.temporal_patch_size * vision.patch_size**2
    gen = torch.Generator().manual_seed(seed)
    return [
        {"pixel_values": torch.randn(t * h * w, row, generator=gen), "image_grid_thw": torch.tensor([[t, h, w]])}
        for t, h, w in grids
    ]


def tower_split_vs_whole(model_dir: str, grids: list[tuple[int, int, int]]) -> dict:
    """Load the Qwen2-VL checkpoint on this rank and encode images of these grids twice: every item in one call
    (the replicated tower) and split over the group. {"whole": [N, H], "split": per item [n_i, H], "mine": ...}."""
    from transformers import AutoConfig

    from vlserve.models import load_model

    hf_config = AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, hf_config, torch.float32, torch.device("cpu"))
    items = qwen2_vl_image_items(hf_config, grids)
    merge = hf_config.vision_config.spatial_merge_size
    lengths = [t * h * w // merge**2 for t, h, w in grids]
    whole = model.embed_multimodal("image", concat_mm_data(items))
    mine: list[list[int]] = []

    def encode(indices: list[int]) -> torch.Tensor:
        mine.append(list(indices))
        return model.embed_multimodal("image", concat_mm_data([items[i] for i in indices]))

    split = encode_across_ranks(encode, lengths, torch.device("cpu"))
    return {"whole": whole, "split": [t.clone() for t in split], "mine": mine[0] if mine else None}


class StandInTower(torch.nn.Module):
    """`embed_multimodal(modality, {"rows": [n, W]})` -> the rows themselves (+1 for video, +2 for audio), recording
    how many items each call had: a tower whose output tells which item every row came from."""

    OFFSETS = {"image": 0.0, "video": 1.0, "audio": 2.0}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def embed_multimodal(self, modality: str, data: dict) -> torch.Tensor:
        self.calls.append((modality, len(data["item"])))
        return data["rows"] + self.OFFSETS[modality]


class HalfFoundConnector:
    """An encoder-cache connector that finds `found` items on this rank only: a producer's file seen by one rank."""

    def __init__(self, found: set[str], width: int) -> None:
        self.found, self.width, self.saved, self.counters = found, width, [], {}

    def load(self, mm_hash: str, length: int) -> torch.Tensor | None:
        return torch.full((length, self.width), -1.0) if mm_hash in self.found else None

    def save(self, mm_hash: str, emb: torch.Tensor) -> None:
        self.saved.append(mm_hash)


def runner_step_split(items: list[tuple[str, int]], width: int, found_on_rank0: list[str]) -> dict:
    """An `EncoderRunner` with `split_across_ranks` runs one step of two requests holding these (modality, length)
    items (mm_hash "h<i>"), with a connector that finds `found_on_rank0` on rank 0 only. {"outputs": mm_hash ->
    embeddings, "calls": the tower calls on this rank, "local": items this rank encoded, "total": the counter}."""
    from types import SimpleNamespace

    from vlserve.core.sched_output import CachedRequestData, SchedulerOutput
    from vlserve.multimodal.inputs import MultiModalFeature
    from vlserve.worker.encoder_runs import EncoderRunner

    feats = [
        MultiModalFeature(modality, f"h{i}", 0, n, {"rows": synthetic_item(i, n, width, torch.float32), "item": [i]})
        for i, (modality, n) in enumerate(items)
    ]
    half = len(feats) // 2
    requests = {
        "a": SimpleNamespace(lora_request=None, mm_features=feats[:half]),
        "b": SimpleNamespace(lora_request=None, mm_features=feats[half:]),
    }
    so = SchedulerOutput(
        [],
        CachedRequestData(),
        {"a": 1, "b": 1},
        2,
        scheduled_encoder_inputs={"a": list(range(half)), "b": list(range(len(feats) - half))},
    )
    model = StandInTower()
    runner = EncoderRunner(model, torch.device("cpu"))
    runner.split_across_ranks = True
    runner.ec_connector = HalfFoundConnector(set(found_on_rank0) if tp_rank() == 0 else set(), width)
    runner.run(so, requests)
    counters = runner.counters()
    return {
        "outputs": {f.mm_hash: runner.lookup(f.mm_hash).clone() for f in feats},
        "calls": model.calls,
        "local": counters.num_local_runs,
        "total": counters.num_runs,
        "saved": runner.ec_connector.saved,
    }


def sharded_tower_vs_whole(
    model_dir: str, grids: list[tuple[int, int, int]], dtype_name: str, quantization: str | None = None
) -> dict:
    """Load the checkpoint on this rank twice, its tower whole and split over the group (`shard_towers`), both
    packed as the runner packs towers (and quantized by `mm_encoder_quantization=quantization`), and encode images of these grids with each: {"whole": [N, H], "sharded":
    [N, H], "<label>_qkv_rows": this rank's rows of block 0's qkv, "<label>_params": the tower's parameters here;
    with a quantization also "float": the float tower's whole embeddings}."""
    from transformers import AutoConfig

    from vlserve.kernels.packed_linear import pack_linears_for_cpu
    from vlserve.models import load_model

    hf_config = AutoConfig.from_pretrained(model_dir)
    dtype = getattr(torch, dtype_name)
    out = {}
    runs = [("whole", False, quantization), ("sharded", True, quantization)]
    if quantization is not None:
        runs.append(("float", False, None))
    for label, shard, method in runs:
        model = load_model(
            model_dir, hf_config, dtype, torch.device("cpu"), mm_encoder_quantization=method, shard_towers=shard
        )
        out[f"{label}_params"] = sum(p.numel() for p in model.visual.parameters())
        out[f"{label}_qkv_rows"] = model.visual.blocks[0].attn.qkv.out_features
        pack_linears_for_cpu(model, many_rows=model.encoder_parts())
        items = qwen2_vl_image_items(hf_config, grids)
        for item in items:
            item["pixel_values"] = item["pixel_values"].to(dtype)
        out[label] = model.embed_multimodal("image", concat_mm_data(items)).float()
    return out
