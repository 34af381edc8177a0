"""Chat JSONL for training the demo model's EAGLE head: `python -m training.eagle_data --out FILE [--num N]`.

Each line is {"messages": [one user turn: an image (PNG) or clip (mp4) as a data URL + a question]} over fresh
seeded scenes and every question form, the format `python -m training.train_eagle --data` reads. The recipe for
the shipped head:

    python -m training.eagle_data --out /tmp/demo_eagle.jsonl
    python -m training.train_eagle --target vlserve/demo/model --data /tmp/demo_eagle.jsonl \
        --out vlserve/demo/model/eagle --k 4
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import tempfile

DATA_SEED = 777  # neither the training stream (0) nor the eval set uses it


def _data_url(scene) -> tuple[str, str]:
    """("image_url" | "video_url", data URL) for a scene's rendering."""
    from vlserve.demo import world

    if isinstance(scene, world.VideoScene):
        with tempfile.TemporaryDirectory() as d:
            path = world.write_mp4(world.render_video(scene), os.path.join(d, "clip.mp4"))
            with open(path, "rb") as f:
                return "video_url", "data:video/mp4;base64," + base64.b64encode(f.read()).decode()
    buf = io.BytesIO()
    world.render_image(scene).save(buf, format="PNG")
    return "image_url", "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def make_items(num: int, seed: int = DATA_SEED, video_prob: float = 0.3) -> list[dict]:
    """num chat items, forms drawn uniformly per media kind."""
    from vlserve.demo import world

    rng = random.Random(seed)
    items = []
    for _ in range(num):
        scene = world.sample_video(rng) if rng.random() < video_prob else world.sample_scene(rng)
        _, question, _ = world.sample_qa(rng, scene)
        part, url = _data_url(scene)
        items.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": part, part: {"url": url}}, {"type": "text", "text": question}],
                    }
                ]
            }
        )
    return items


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description="Write chat JSONL of demo-world questions for training.train_eagle.")
    p.add_argument("--out", required=True)
    p.add_argument("--num", type=int, default=600)
    p.add_argument("--seed", type=int, default=DATA_SEED)
    a = p.parse_args(argv)
    with open(a.out, "w") as f:
        for item in make_items(a.num, a.seed):
            f.write(json.dumps(item) + "\n")
    print(f"wrote {a.num} items to {a.out}")


if __name__ == "__main__":
    main()
