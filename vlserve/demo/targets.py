"""Auxiliary training targets for the demo model: deep supervision of a small "circuit" inside the standard
Qwen2-VL network (used only during training; the probe heads are discarded, the checkpoint stays a plain Qwen2-VL).

Trained from scratch in a few hundred steps, the LM otherwise sits at chance for a long time: it has to discover
which of ~36 visual tokens hold the shapes. So each stage gets its own signal:
  1. vision tower output, per visual token (one 28x28 cell of the image, or of a pair of video frames): kind and
     color of the shape covering the cell's center or centered in it (0 = none; background cells weigh
     BACKGROUND_WEIGHT);
  2. LM after PLACE_LAYER layers, per still-image token: its place (the shape's, else the nearest to the cell);
     per video object token after the first frame pair: the motion direction (it can compare with the object's
     cell in earlier pairs through M-RoPE offsets);
  3. LM layer ATTN_LAYER, heads 0-2, at every text token after the media: attention mass on the cells of
     circle / square / triangle respectively (when present) - kind-specific "pointer" heads;
  4. LM after SUMMARY_LAYER layers, at those same text tokens: the whole scene (count; color and place of each
     kind, or absent; for clips kind, color and direction), so the last layer only has to look answers up.
"""
from __future__ import annotations

import math

from vlserve.demo import world

PLACE_LAYER = 1
ATTN_LAYER = 2
SUMMARY_LAYER = 3
IGNORE = -100
BACKGROUND_WEIGHT = 0.1
SUMMARY_WEIGHT = 0.5
SUMMARY_CLASSES = {"count": 3, **{f"color_{k}": len(world.COLORS) + 1 for k in world.SHAPES},
                   **{f"place_{k}": len(world.PLACES) + 1 for k in world.SHAPES},
                   "video_kind": len(world.SHAPES), "video_color": len(world.COLORS),
                   "video_direction": len(world.DIRECTIONS)}
NUM_KINDS = len(world.SHAPES) + 1  # 0 = no shape center here
NUM_COLORS = len(world.COLORS) + 1
COLOR_INDEX = {c: i + 1 for i, c in enumerate(world.COLORS)}
KIND_INDEX = {k: i + 1 for i, k in enumerate(world.SHAPES)}


def _nearest_place(x: float, y: float) -> int:
    return min(range(len(world.PLACES)), key=lambda i: math.dist((x, y), world.PLACE_XY[world.PLACES[i]]))


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
    patch grid (t, h, w) before the merge -> {"kind", "color", "place", "motion"} lists of equal length."""
    t, gh, gw = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    n = t * gh * gw
    kind, color = [0] * n, [0] * n
    place = [_nearest_place((j + 0.5) / gw, (i + 0.5) / gh) for i in range(gh) for j in range(gw)] * t
    motion = [IGNORE] * n

    def label(shapes, g: int, scene_w: int, scene_h: int) -> None:
        """Fill kind/color (and place, for stills) of time group g's cells from `shapes`."""
        for i in range(gh):
            for j in range(gw):
                x, y = (j + 0.5) / gw * scene_w, (i + 0.5) / gh * scene_h
                for s in shapes:
                    own = (min(gh - 1, int(s.cy / scene_h * gh)), min(gw - 1, int(s.cx / scene_w * gw))) == (i, j)
                    if own or _covers(s, x, y):
                        k = (g * gh + i) * gw + j
                        kind[k], color[k] = KIND_INDEX[s.kind], COLOR_INDEX[s.color]
                        if s.place:
                            place[k] = world.PLACES.index(s.place)

    if isinstance(scene, world.VideoScene):
        last = scene.num_frames - 1
        place = [IGNORE] * n
        for g in range(t):  # group g holds frames 2g and 2g+1 (the processor repeats the last frame if odd)
            (x0, y0), (x1, y1) = scene.centers[min(2 * g, last)], scene.centers[min(2 * g + 1, last)]
            label([_moved(scene.shape, (x0 + x1) / 2, (y0 + y1) / 2)], g, scene.width, scene.height)
    else:
        label(scene.shapes, 0, scene.width, scene.height)
    if isinstance(scene, world.VideoScene):  # object cells from the second frame pair on
        per_group = gh * gw
        motion = [world.DIRECTIONS.index(scene.direction) if k and i >= per_group else IGNORE
                  for i, k in enumerate(kind)]
    return {"kind": kind, "color": color, "place": place, "motion": motion}


def summary_targets(scene) -> dict[str, int]:
    """The per-sample summary labels (SUMMARY_CLASSES keys; IGNORE where they do not apply)."""
    out = dict.fromkeys(SUMMARY_CLASSES, IGNORE)
    if isinstance(scene, world.VideoScene):
        s = scene.shape
        out.update(video_kind=world.SHAPES.index(s.kind), video_color=list(world.COLORS).index(s.color),
                   video_direction=world.DIRECTIONS.index(scene.direction))
        return out
    out["count"] = len(scene.shapes) - 1
    for k in world.SHAPES:
        out[f"color_{k}"], out[f"place_{k}"] = 0, 0
    for s in scene.shapes:
        out[f"color_{s.kind}"], out[f"place_{s.kind}"] = COLOR_INDEX[s.color], world.PLACES.index(s.place) + 1
    return out


def batch_targets(scenes: list, image_grid_thw, video_grid_thw) -> dict:
    """Concatenated labels (LongTensors [N]) for a batch whose samples each hold one media item, in sample order
    (the order of visual tokens in the flattened batch). Images and videos take their grids from their own lists."""
    import torch

    images = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
    videos = iter(video_grid_thw.tolist() if video_grid_thw is not None else [])
    out: dict[str, list[int]] = {"kind": [], "color": [], "place": [], "motion": []}
    summary: dict[str, list[int]] = {k: [] for k in SUMMARY_CLASSES}
    for sc in scenes:
        grid = next(videos) if isinstance(sc, world.VideoScene) else next(images)
        for key, vals in scene_targets(sc, tuple(grid)).items():
            out[key] += vals
        for key, val in summary_targets(sc).items():
            summary[key].append(val)
    batch = {f"aux_{k}": torch.tensor(v, dtype=torch.long) for k, v in out.items()}
    batch.update({f"aux_sum_{k}": torch.tensor(v, dtype=torch.long) for k, v in summary.items()})
    return batch


class AuxHeads:
    """Linear probes for the auxiliary targets, created on the fly; `loss(...)` returns the stage losses."""

    def __init__(self, hidden_size: int):
        import torch.nn as nn

        self.vision = nn.Linear(hidden_size, NUM_KINDS + NUM_COLORS)
        self.place = nn.Linear(hidden_size, len(world.PLACES) + len(world.DIRECTIONS))
        self.summary = nn.Linear(hidden_size, sum(SUMMARY_CLASSES.values()))

    def parameters(self):
        """All head parameters (for the optimizer)."""
        return [p for m in (self.vision, self.place, self.summary) for p in m.parameters()]

    def loss(self, hidden_states, attentions, input_ids, attention_mask, token_ids: dict, batch: dict) -> dict:
        """hidden_states: output_hidden_states ([B, L, H] each); attentions: output_attentions ([B, heads, L, L]
        each); input_ids / attention_mask [B, L]; token_ids: the config's image/video/vision_end token ids.
        -> {"kind", "color", "place", "motion", "pointer", "summary"}: scalar losses (absent targets left out)."""
        import torch
        import torch.nn.functional as F

        vis_mask = (input_ids == token_ids["image"]) | (input_ids == token_ids["video"])  # [B, L]
        out = {}
        # 1. vision tower outputs (row-major over the batch = the order of the labels)
        logits = self.vision(hidden_states[0][vis_mask])  # [N, kinds + colors]
        wk = torch.full((NUM_KINDS,), 1.0).index_fill_(0, torch.tensor([0]), BACKGROUND_WEIGHT)
        wc = torch.full((NUM_COLORS,), 1.0).index_fill_(0, torch.tensor([0]), BACKGROUND_WEIGHT)
        out["kind"] = F.cross_entropy(logits[:, :NUM_KINDS], batch["aux_kind"], weight=wk)
        out["color"] = F.cross_entropy(logits[:, NUM_KINDS:], batch["aux_color"], weight=wc)
        # 2. absolute place of every still-image token; motion of video object tokens
        n_places = len(world.PLACES)
        p_logits = self.place(hidden_states[PLACE_LAYER][vis_mask])  # [N, places + directions]
        if (batch["aux_place"] != IGNORE).any():
            out["place"] = F.cross_entropy(p_logits[:, :n_places], batch["aux_place"], ignore_index=IGNORE)
        if (batch["aux_motion"] != IGNORE).any():
            out["motion"] = F.cross_entropy(p_logits[:, n_places:], batch["aux_motion"], ignore_index=IGNORE)
        # text tokens after the media: from the first <|vision_end|> on, padding excluded
        end_pos = (input_ids == token_ids["vision_end"]).int().argmax(dim=1)  # [B]
        pos = torch.arange(input_ids.shape[1])[None]  # [1, L]
        queries = (pos >= end_pos[:, None]) & (attention_mask > 0)  # [B, L]
        # 3. pointer heads: head k of layer ATTN_LAYER puts its attention on the cells of kind k+1
        kind_map = torch.zeros_like(input_ids)  # [B, L]
        kind_map[vis_mask] = batch["aux_kind"]
        n_kinds = len(world.SHAPES)
        onehot = F.one_hot(kind_map, NUM_KINDS)[..., 1:].float()  # [B, L(keys), kinds]
        attn = attentions[ATTN_LAYER][:, :n_kinds]  # [B, kinds, L(queries), L(keys)]
        mass = torch.einsum("bkqj,bjk->bkq", attn, onehot)  # [B, kinds, L]
        valid = queries[:, None, :] & (onehot.sum(1) > 0)[:, :, None]  # [B, kinds, L]
        if valid.any():
            out["pointer"] = -(torch.log(mass + 1e-4) * valid).sum() / valid.sum()
        # 4. scene summary at every text token after the media
        s_logits = self.summary(hidden_states[SUMMARY_LAYER][queries])  # [Q, classes]
        rows = queries.nonzero()[:, 0]  # [Q]: the sample of each query token
        total, offset = 0.0, 0
        for name, n in SUMMARY_CLASSES.items():
            target = batch[f"aux_sum_{name}"][rows]  # [Q]
            if (target != IGNORE).any():
                total = total + F.cross_entropy(s_logits[:, offset:offset + n], target, ignore_index=IGNORE)
            offset += n
        out["summary"] = SUMMARY_WEIGHT * total
        return out
