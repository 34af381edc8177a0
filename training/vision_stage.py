"""Stage 1 of demo training: the vision tower alone, on dense per-patch and per-cell targets.

A tiny ViT trained from scratch through the language model learns shapes very slowly: it first has to separate a
shape's silhouette from its (random) colors. Alone, at ~14 ms a sample instead of ~80, and with dense targets, it gets
there in minutes:
  - per patch (after the first block): the silhouette, i.e. the fraction of each 2x2-pixel sub-square of the 14x14
    patch covered by a shape (7x7 values; for clips averaged over the two frames the patch holds);
  - per cell (the merger's output, one LM token): shape present, its kind, its color, and for clips its motion
    direction (the Conv3d sees both frames of a pair, so the leading and trailing edges are visible).
The probe heads are discarded afterwards, except the cell probe, which stage 2 keeps using (training.targets).
"""

from __future__ import annotations

import random
import time

import numpy as np

from training.targets import KIND_SLICE, batch_targets, cell_losses
from vlserve.demo import world

SUB = 7  # silhouette resolution per patch side
MASK_BLOCK = 0  # vision block whose output predicts the silhouettes


def _silhouette(shapes, w: int, h: int, gw: int, gh: int, patch: int = 14, supersample: int = 2) -> np.ndarray:
    """Coverage of `shapes` ((shape, center) pairs on a w x h scene) on the processor's (gh*patch, gw*patch) resize,
    pooled to SUB x SUB per patch -> float32 [gh*SUB, gw*SUB]. Drawn on the resized grid itself (each axis scaled on
    its own, as the processor does when rounding makes the grid non-square)."""
    from PIL import Image, ImageDraw

    W, H = gw * patch * supersample, gh * patch * supersample
    img = Image.new("L", (W, H), 0)
    draw = ImageDraw.Draw(img)
    sx, sy = W / w, H / h
    for s, (cx, cy) in shapes:
        if s.kind == "circle":
            draw.ellipse([(cx - s.r) * sx, (cy - s.r) * sy, (cx + s.r) * sx, (cy + s.r) * sy], fill=255)
        else:
            draw.polygon([(x * sx, y * sy) for x, y in world._shape_polygon(s.kind, cx, cy, s.r, s.rotation)], fill=255)
    return np.asarray(img.resize((gw * SUB, gh * SUB), Image.BOX), np.float32) / 255.0


def patch_silhouettes(scene, grid_thw, merge: int = 2) -> np.ndarray:
    """Silhouette targets for one media item in the processor's patch order (t, h/m, w/m, m, m) -> [patches, SUB*SUB]."""
    t, gh, gw = (int(v) for v in grid_thw)
    if isinstance(scene, world.VideoScene):
        last = scene.num_frames - 1
        groups = []
        for g in range(t):  # frames 2g and 2g+1 (the processor repeats the last frame when the count is odd)
            a = [
                _silhouette([(scene.shape, scene.centers[min(f, last)])], scene.width, scene.height, gw, gh)
                for f in (2 * g, 2 * g + 1)
            ]
            groups.append((a[0] + a[1]) / 2)
    else:
        groups = [_silhouette([(s, (s.cx, s.cy)) for s in scene.shapes], scene.width, scene.height, gw, gh)]
    out = []
    for a in groups:  # [gh*SUB, gw*SUB] -> patch order
        a = a.reshape(gh // merge, merge, SUB, gw // merge, merge, SUB).transpose(0, 3, 1, 4, 2, 5)
        out.append(a.reshape(gh * gw, SUB * SUB))
    return np.concatenate(out)


def vision_batch(rng: random.Random, processor, batch_size: int, video_prob: float) -> dict:
    """Render batch_size media items (each batch all images or all videos, chosen with video_prob) -> tensors:
    pixel_values, grid_thw, cell targets (kind/color/motion [cells]) and silhouettes [patches, SUB*SUB]."""
    import torch

    is_video = rng.random() < video_prob
    scenes = [world.sample_video(rng) if is_video else world.sample_scene(rng) for _ in range(batch_size)]
    if is_video:
        out = processor.video_processor(videos=[world.render_video(s) for s in scenes], return_tensors="pt")
        pixels, grid = out["pixel_values_videos"], out["video_grid_thw"]
        labels = batch_targets(scenes, None, grid)
    else:
        out = processor.image_processor(images=[world.render_image(s) for s in scenes], return_tensors="pt")
        pixels, grid = out["pixel_values"], out["image_grid_thw"]
        labels = batch_targets(scenes, grid, None)
    masks = np.concatenate([patch_silhouettes(s, g) for s, g in zip(scenes, grid.tolist())])
    return {
        "pixel_values": pixels,
        "grid_thw": grid,
        "kind": labels["aux_kind"],
        "color": labels["aux_color"],
        "motion": labels["aux_motion"],
        "silhouette": torch.from_numpy(masks),
    }


class _Stream:
    def __init__(self, processor, seed: int, batch_size: int, video_prob: float):
        self.args = (processor, seed, batch_size, video_prob)

    def __iter__(self):
        import torch

        torch.set_num_threads(1)
        processor, seed, batch_size, video_prob = self.args
        rng = random.Random(seed)
        while True:
            yield vision_batch(rng, processor, batch_size, video_prob)


def pretrain_vision(
    model,
    processor,
    cell_probe,
    steps: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    video_prob: float = 0.35,
    workers: int = 1,
    minutes: float | None = None,
    log_every: int = 50,
) -> dict:
    """Train model's vision tower (and cell_probe, a Linear(hidden, NUM_CELL_OUTPUTS)) for `steps` steps; the
    silhouette head is thrown away. Returns {"steps", "seconds", "history"}."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from training.schedule import in_background, lr_at, schedule_step

    visual = model.model.visual
    embed_dim = model.config.vision_config.embed_dim
    torch.manual_seed(seed + 1)
    mask_head = torch.nn.Linear(embed_dim, SUB * SUB)
    feats: dict = {}
    hook = visual.blocks[MASK_BLOCK].register_forward_hook(lambda m, i, o: feats.__setitem__("x", o))
    params = list(visual.parameters()) + list(cell_probe.parameters()) + list(mask_head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    data = in_background(_Stream(processor, seed + 1000, batch_size, video_prob), workers)
    start, history, ema = time.time(), [], {}
    bar = tqdm(range(steps), desc="vision", dynamic_ncols=True, mininterval=2.0)
    step = 0
    for step in bar:
        step_lr = lr_at(schedule_step(step, steps, time.time() - start, minutes), steps, lr, warmup=30)
        for g in opt.param_groups:
            g["lr"] = step_lr
        b = next(data)
        cells = visual(b["pixel_values"], grid_thw=b["grid_thw"])  # [cells, hidden]
        cells = getattr(cells, "pooler_output", cells)  # transformers 5.x returns an output object
        logits = cell_probe(cells)  # [cells, NUM_CELL_OUTPUTS]
        parts = cell_losses(logits, b["kind"], b["color"], b["motion"])
        parts["silhouette"] = F.binary_cross_entropy_with_logits(mask_head(feats["x"]), b["silhouette"])
        loss = sum(parts.values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            fg = b["kind"] > 0
            acc = (logits[fg, KIND_SLICE].argmax(-1) + 1 == b["kind"][fg]).float().mean().item()
        for k, v in {**{k: v.item() for k, v in parts.items()}, "kind_acc": acc}.items():
            ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
        bar.set_postfix(kind_acc=f"{ema['kind_acc']:.3f}", loss=f"{loss.item():.3f}")
        if (step + 1) % log_every == 0:
            history.append(
                {"step": step + 1, "seconds": round(time.time() - start, 1), **{k: round(v, 4) for k, v in ema.items()}}
            )
            tqdm.write(f"vision step {step + 1} " + " ".join(f"{k} {v:.3f}" for k, v in ema.items()))
        if minutes is not None and time.time() - start > 60 * minutes:
            tqdm.write(f"vision stage: time budget of {minutes} min reached after {step + 1} steps")
            break
    bar.close()
    hook.remove()
    return {"steps": step + 1, "seconds": round(time.time() - start, 1), "history": history}


__all__ = ["pretrain_vision", "patch_silhouettes", "vision_batch"]
