"""Auxiliary training targets for the demo model: deep supervision of a small "circuit" inside the standard
Qwen2-VL network (used only during training; the probe heads are discarded, the checkpoint stays a plain Qwen2-VL).

Trained from scratch in a few hundred steps, the LM otherwise sits at chance for a long time: it has to discover
which of ~36 visual tokens hold the shapes. So each stage gets its own signal:
  1. vision tower output, per visual token (one 28x28 cell of the image, or of a pair of video frames): whether a
     shape covers the cell's center (or is centered in it), and then its kind, color and, in clips, motion direction
     (`cell_losses`; the same probe is first trained alone in training.vision_stage);
  2. LM after POSITION_LAYER layers, per visual token: the cell's center (x, y) in [0, 1], a linear regression (the
     LM has to derive absolute positions from M-RoPE offsets, e.g. to <|vision_start|>);
  3. LM layer ATTN_LAYER at every text token after the media: heads 0-2 put their attention on the cells of
     circle / square / triangle respectively (when present) - kind-specific "pointer" heads; in clips head 3
     points at the object's cells in the first frame pair (start vs. average position gives the direction);
  4. LM after SUMMARY_LAYER layers, at those same text tokens: the whole scene (count; color and place of each
     kind, or absent; for clips kind, color and direction), so the last layer only has to look answers up.
"""

from __future__ import annotations

import math

from vlserve.demo import world

POSITION_LAYER = 1
ATTN_LAYER = 2
SUMMARY_LAYER = 3
IGNORE = -100
SUMMARY_WEIGHT = 0.5
SUMMARY_CLASSES = {
    "count": 3,
    **{f"color_{k}": len(world.COLORS) + 1 for k in world.SHAPES},
    **{f"place_{k}": len(world.PLACES) + 1 for k in world.SHAPES},
    "video_kind": len(world.SHAPES),
    "video_color": len(world.COLORS),
    "video_direction": len(world.DIRECTIONS),
}
NUM_KINDS = len(world.SHAPES) + 1  # 0 = no shape in the cell
# cell probe layout: [background logit | kinds | colors | directions]
KIND_SLICE = slice(1, 1 + len(world.SHAPES))
COLOR_SLICE = slice(KIND_SLICE.stop, KIND_SLICE.stop + len(world.COLORS))
MOTION_SLICE = slice(COLOR_SLICE.stop, COLOR_SLICE.stop + len(world.DIRECTIONS))
NUM_CELL_OUTPUTS = MOTION_SLICE.stop
COLOR_INDEX = {c: i + 1 for i, c in enumerate(world.COLORS)}
KIND_INDEX = {k: i + 1 for i, k in enumerate(world.SHAPES)}


def _covers(s, x: float, y: float) -> bool:
    """Whether point (x, y) (pixels) lies inside shape s."""
    if s.kind == "circle":
        return math.dist((x, y), (s.cx, s.cy)) <= s.r
    poly, inside = world._shape_polygon(s.kind, s.cx, s.cy, s.r, s.rotation), False
    for (x1, y1), (x2, y2) in zip(poly, poly[1:] + poly[:1]):  # ray casting
        if (y1 > y) != (y2 > y) and x < (x2 - x1) * (y - y1) / (y2 - y1) + x1:
            inside = not inside
    return inside


def _moved(s, cx: float, cy: float):
    return world.Shape(s.kind, s.color, s.place, cx, cy, s.r, s.rotation, s.fill)


def scene_targets(scene, grid_thw: tuple[int, int, int], merge: int = 2) -> dict[str, list[int]]:
    """Labels for one media item's visual tokens in the merger's order (t, row, col); grid_thw is the processor's
    patch grid (t, h, w) before the merge -> {"kind", "color", "motion", "x", "y", "first"} lists of equal length."""
    t, gh, gw = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    n = t * gh * gw
    kind, color, motion = [0] * n, [0] * n, [IGNORE] * n
    xy = [((j + 0.5) / gw, (i + 0.5) / gh) for i in range(gh) for j in range(gw)] * t
    first = [1 if g == 0 else 0 for g in range(t) for _ in range(gh * gw)]  # cell in the first frame pair

    def label(shapes, g: int, scene_w: int, scene_h: int) -> None:
        """Fill kind/color of time group g's cells from `shapes`."""
        for i in range(gh):
            for j in range(gw):
                x, y = (j + 0.5) / gw * scene_w, (i + 0.5) / gh * scene_h
                for s in shapes:
                    own = (min(gh - 1, int(s.cy / scene_h * gh)), min(gw - 1, int(s.cx / scene_w * gw))) == (i, j)
                    if own or _covers(s, x, y):
                        k = (g * gh + i) * gw + j
                        kind[k], color[k] = KIND_INDEX[s.kind], COLOR_INDEX[s.color]

    if isinstance(scene, world.VideoScene):
        last = scene.num_frames - 1
        for g in range(t):  # group g holds frames 2g and 2g+1 (the processor repeats the last frame if odd)
            (x0, y0), (x1, y1) = scene.centers[min(2 * g, last)], scene.centers[min(2 * g + 1, last)]
            label([_moved(scene.shape, (x0 + x1) / 2, (y0 + y1) / 2)], g, scene.width, scene.height)
        motion = [world.DIRECTIONS.index(scene.direction) if k else IGNORE for k in kind]
    else:
        label(scene.shapes, 0, scene.width, scene.height)
    return {
        "kind": kind,
        "color": color,
        "motion": motion,
        "x": [p[0] for p in xy],
        "y": [p[1] for p in xy],
        "first": first,
    }


def summary_targets(scene) -> dict[str, int]:
    """The per-sample summary labels (SUMMARY_CLASSES keys; IGNORE where they do not apply)."""
    out = dict.fromkeys(SUMMARY_CLASSES, IGNORE)
    if isinstance(scene, world.VideoScene):
        s = scene.shape
        out.update(
            video_kind=world.SHAPES.index(s.kind),
            video_color=list(world.COLORS).index(s.color),
            video_direction=world.DIRECTIONS.index(scene.direction),
        )
        return out
    out["count"] = len(scene.shapes) - 1
    for k in world.SHAPES:
        out[f"color_{k}"], out[f"place_{k}"] = 0, 0
    for s in scene.shapes:
        out[f"color_{s.kind}"], out[f"place_{s.kind}"] = COLOR_INDEX[s.color], world.PLACES.index(s.place) + 1
    return out


def batch_targets(scenes: list, image_grid_thw, video_grid_thw) -> dict:
    """Concatenated labels (tensors [N]; x/y float) for a batch whose samples each hold one media item, in sample order
    (the order of visual tokens in the flattened batch). Images and videos take their grids from their own lists."""
    import torch

    images = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
    videos = iter(video_grid_thw.tolist() if video_grid_thw is not None else [])
    out: dict[str, list] = {"kind": [], "color": [], "motion": [], "x": [], "y": [], "first": []}
    summary: dict[str, list[int]] = {k: [] for k in SUMMARY_CLASSES}
    for sc in scenes:
        grid = next(videos) if isinstance(sc, world.VideoScene) else next(images)
        for key, vals in scene_targets(sc, tuple(grid)).items():
            out[key] += vals
        for key, val in summary_targets(sc).items():
            summary[key].append(val)
    batch = {
        f"aux_{k}": torch.tensor(v, dtype=torch.float32 if k in ("x", "y") else torch.long) for k, v in out.items()
    }
    batch.update({f"aux_sum_{k}": torch.tensor(v, dtype=torch.long) for k, v in summary.items()})
    return batch


def cell_losses(logits, kind, color, motion) -> dict:
    """Cell-probe losses: logits [N, NUM_CELL_OUTPUTS]; kind / color [N] (0 = no shape), motion [N] (IGNORE where
    no moving shape) -> {"presence", "kind", "color"[, "motion"]}. Kind and color are scored on shape cells only, so
    the few shape cells are not drowned by the background."""
    import torch.nn.functional as F

    fg = kind > 0
    out = {"presence": F.binary_cross_entropy_with_logits(logits[:, 0], (~fg).float())}
    if fg.any():
        out["kind"] = F.cross_entropy(logits[fg, KIND_SLICE], kind[fg] - 1)
        out["color"] = F.cross_entropy(logits[fg, COLOR_SLICE], color[fg] - 1)
    if (motion != IGNORE).any():
        out["motion"] = F.cross_entropy(logits[:, MOTION_SLICE], motion, ignore_index=IGNORE)
    return out


class AuxHeads:
    """Linear probes for the auxiliary targets, created on the fly; `loss(...)` returns the stage losses."""

    def __init__(self, hidden_size: int, cell_probe=None):
        import torch.nn as nn

        self.vision = cell_probe if cell_probe is not None else nn.Linear(hidden_size, NUM_CELL_OUTPUTS)
        self.position = nn.Linear(hidden_size, 2)  # (x, y)
        self.summary = nn.Linear(hidden_size, sum(SUMMARY_CLASSES.values()))

    def parameters(self):
        """All head parameters (for the optimizer)."""
        return [p for m in (self.vision, self.position, self.summary) for p in m.parameters()]

    def loss(self, hidden_states, pointer_attn, input_ids, attention_mask, token_ids: dict, batch: dict) -> dict:
        """hidden_states: output_hidden_states ([B, L, H] each); pointer_attn: layer ATTN_LAYER's attention
        probabilities [B, heads, L, L]; input_ids / attention_mask [B, L]; token_ids: the config's image/video/vision_end token ids.
        -> {"kind", "color", "xy", "pointer", "summary"}: scalar losses (absent targets left out)."""
        import torch
        import torch.nn.functional as F

        vis_mask = (input_ids == token_ids["image"]) | (input_ids == token_ids["video"])  # [B, L]
        out = {}
        # 1. vision tower outputs (row-major over the batch = the order of the labels)
        logits = self.vision(hidden_states[0][vis_mask])  # [N, NUM_CELL_OUTPUTS]
        out.update(cell_losses(logits, batch["aux_kind"], batch["aux_color"], batch["aux_motion"]))
        # 2. absolute position of every visual token
        xy = self.position(hidden_states[POSITION_LAYER][vis_mask])  # [N, 2]
        out["xy"] = 10 * F.mse_loss(xy, torch.stack([batch["aux_x"], batch["aux_y"]], dim=1))
        # text tokens after the media: from the first <|vision_end|> on, padding excluded
        end_pos = (input_ids == token_ids["vision_end"]).int().argmax(dim=1)  # [B]
        pos = torch.arange(input_ids.shape[1])[None]  # [1, L]
        queries = (pos >= end_pos[:, None]) & (attention_mask > 0)  # [B, L]
        # 3. pointer heads: head k of layer ATTN_LAYER attends to the cells of kind k+1; head 3 (clips) to the
        # object's cells in the first frame pair
        kind_map = torch.zeros_like(input_ids)  # [B, L]
        kind_map[vis_mask] = batch["aux_kind"]
        onehot = F.one_hot(kind_map, NUM_KINDS)[..., 1:].float()  # [B, L(keys), kinds]
        first_map = torch.zeros_like(input_ids)  # [B, L]
        first_map[vis_mask] = batch["aux_first"]
        is_video = (input_ids == token_ids["video"]).any(dim=1)  # [B]
        start = ((kind_map > 0) & (first_map > 0) & is_video[:, None]).float()[..., None]  # [B, L, 1]
        targets = torch.cat([onehot, start], dim=-1)  # [B, L(keys), 4]
        attn = pointer_attn[:, : targets.shape[-1]]  # [B, 4, L(queries), L(keys)]
        mass = torch.einsum("bkqj,bjk->bkq", attn, targets)  # [B, 4, L]
        valid = queries[:, None, :] & (targets.sum(1) > 0)[:, :, None]  # [B, 4, L]
        if valid.any():
            out["pointer"] = -(torch.log(mass + 1e-4) * valid).sum() / valid.sum()
        # 4. scene summary at every text token after the media
        s_logits = self.summary(hidden_states[SUMMARY_LAYER][queries])  # [Q, classes]
        rows = queries.nonzero()[:, 0]  # [Q]: the sample of each query token
        total, offset = 0.0, 0
        for name, n in SUMMARY_CLASSES.items():
            target = batch[f"aux_sum_{name}"][rows]  # [Q]
            if (target != IGNORE).any():
                total = total + F.cross_entropy(s_logits[:, offset : offset + n], target, ignore_index=IGNORE)
            offset += n
        out["summary"] = SUMMARY_WEIGHT * total
        return out
