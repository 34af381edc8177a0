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
