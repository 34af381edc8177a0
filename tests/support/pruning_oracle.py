"""An oracle for pruned videos (tests only): HF's own tower and decoder, fed by hand.

The video's prompt ids and pixels come from HF's processor; HF's tower encodes them; the tokens to keep are chosen
here with numpy (1 - cosine to the same spatial token one temporal group earlier, the first group whole), the
M-RoPE positions are written out here from the unpruned prompt (text +1 per token; a video group's tokens at
(offset + t * interval, offset + h, offset + w), the text after at its largest + 1), and the dropped tokens are cut
out of the ids, the embeddings and the positions before HF's language model runs greedily on `inputs_embeds` and
`position_ids` (no cache: the whole sequence each step). Nothing of vlserve's pruning, positions or towers is used.
"""

from __future__ import annotations

import numpy as np
import torch


def kept_count(per_group: int, groups: int, rate: float) -> int:
    """floor(total * (1 - rate)), at least one whole group."""
    return max(per_group, int(per_group * groups * (1.0 - rate)))


def _change(cur: np.ndarray, prev: np.ndarray) -> np.ndarray:
    dots = (cur * prev).sum(-1)
    norms = np.maximum(np.linalg.norm(cur, axis=-1) * np.linalg.norm(prev, axis=-1), 1e-8)
    return 1.0 - dots / norms


def _top(scores: list[float], keep: int) -> np.ndarray:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    flags = np.zeros(len(scores), dtype=bool)
    flags[order[:keep]] = True
    return flags


def whole_video_flags(emb: np.ndarray, groups: int, rate: float) -> np.ndarray:
    """Qwen2-VL / Qwen2.5-VL: the kept tokens of `[groups * n, D]`, ranked over the whole video."""
    frames = emb.reshape(groups, -1, emb.shape[-1])
    per_group = frames.shape[1]
    scores = [3.0] * per_group + [float(x) for x in _change(frames[1:], frames[:-1]).reshape(-1)]
    return _top(scores, kept_count(per_group, groups, rate))


def per_group_flags(emb: np.ndarray, groups: int, rate: float) -> np.ndarray:
    """Qwen3-VL: the first group whole, the rest of the kept count spread evenly (remainder to the earlier
    groups), each group ranked against the one before it."""
    frames = emb.reshape(groups, -1, emb.shape[-1])
    per_group = frames.shape[1]
    rest = kept_count(per_group, groups, rate) - per_group
    flags = [np.ones(per_group, dtype=bool)]
    for j in range(1, groups):
        keep = rest // (groups - 1) + (j - 1 < rest % (groups - 1))
        flags.append(_top([float(x) for x in _change(frames[j], frames[j - 1])], keep))
    return np.concatenate(flags)


def hand_positions(ids: list[int], video_id: int, runs: list[tuple[int, int, int]], interval: int) -> torch.Tensor:
    """[3, L] positions of an unpruned prompt whose video-pad runs have merged grids `runs` (t, h, w), in order."""
    cols, next_pos, i, r = [], 0, 0, 0
    while i < len(ids):
        if ids[i] != video_id:
            cols.append((next_pos,) * 3)
            next_pos, i = next_pos + 1, i + 1
            continue
        t, h, w = runs[r]
        grid = [
            (next_pos + a * interval, next_pos + b, next_pos + c) for a in range(t) for b in range(h) for c in range(w)
        ]
        cols += grid
        next_pos = max(max(p) for p in grid) + 1
        i, r = i + t * h * w, r + 1
    return torch.tensor(cols, dtype=torch.long).T.contiguous()


@torch.no_grad()
def pruned_greedy(model, ids: list[int], video_id: int, video_embeds, positions, flags, n: int, deepstack=None):
    """Greedy `n` tokens of HF `model` on the prompt with the unflagged video tokens removed: `video_embeds`
    [N, H] (and `deepstack`, K of [N, H]) are the tower's for the N video tokens, `positions` [3, L] the unpruned
    prompt's. Returns (pruned prompt length, [(new token id, its logprob)])."""
    lm, dev = model.model.language_model, model.device
    ids_t = torch.tensor(ids)
    is_video = ids_t == video_id
    keep_video = torch.from_numpy(flags)
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[is_video.nonzero().reshape(-1)[~keep_video]] = False
    embeds = model.get_input_embeddings()(ids_t[keep].to(dev)).clone()  # [L', H]
    vmask = is_video[keep].to(dev)  # [L']
    embeds[vmask] = video_embeds[keep_video.to(video_embeds.device)].to(embeds)
    pos = positions[:, keep].to(dev)  # [3, L']
    ds = None if deepstack is None else [d[keep_video.to(d.device)] for d in deepstack]
    out = []
    for _ in range(n):
        kwargs = {}
        if ds is not None:
            kwargs = {"visual_pos_masks": vmask[None], "deepstack_visual_embeds": ds}
        hidden = lm(inputs_embeds=embeds[None], position_ids=pos[:, None, :], **kwargs).last_hidden_state
        logits = model.lm_head(hidden[:, -1]).float()[0]  # [V]
        token = int(logits.argmax())
        out.append((token, float(torch.log_softmax(logits, -1)[token])))
        embeds = torch.cat([embeds, model.get_input_embeddings()(torch.tensor([token], device=dev))])
        pos = torch.cat([pos, pos.max().expand(3, 1) + 1], dim=1)
        vmask = torch.cat([vmask, torch.tensor([False], device=dev)])
    return int(keep.sum()), out
