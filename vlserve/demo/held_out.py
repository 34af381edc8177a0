"""The demo world's held-out items (a seed the training stream never uses) and their one-turn chat messages."""

from __future__ import annotations

import random

EVAL_SEED = 20240917


def held_out_set(per_form: int, seed: int = EVAL_SEED) -> list[dict]:
    """per_form items per question form: {"form", "kind" ("image"|"video"), "media", "question", "answer"}."""
    from vlserve.demo import world

    rng = random.Random(seed)
    items = []
    for form in world.FORMS:
        is_video = form in world.VIDEO_FORMS
        for _ in range(per_form):
            scene = world.sample_video(rng) if is_video else world.sample_scene(rng)
            _, q, a = world.sample_qa(rng, scene, form)
            media = world.render_video(scene) if is_video else world.render_image(scene)
            items.append(
                {"form": form, "kind": "video" if is_video else "image", "media": media, "question": q, "answer": a}
            )
    return items


def messages_for(item: dict, engine: str) -> list[dict]:
    """One user turn with the media part (HF processor or vlserve chat format) and the question."""
    if item["kind"] == "image":
        media = {"type": "image"} if engine == "hf" else {"type": "image_pil", "image_pil": item["media"]}
    else:
        media = {"type": "video"} if engine == "hf" else {"type": "video", "video": item["media"]}
    return [{"role": "user", "content": [media, {"type": "text", "text": item["question"]}]}]
