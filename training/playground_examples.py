"""The playground's example media: a few pictures and one clip from the demo world, rendered once and shipped as
static files beside the page (the api layer may not import training/).

    python -m training.playground_examples [--out vlserve/api/static/examples]

writes img1.png ... and clip1.mp4 plus examples.json: for each file its kind and every question the world supports
about it with the world's answer (the page offers them as chips and shows the expected answer); and live mode's
looping clip, live_demo.webm (VP8: every Chromium plays it), with live_demo.json (its frame rate and questions).
"""

from __future__ import annotations

import argparse
import json
import os
import random

import vlserve
from vlserve.demo import world

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(vlserve.__file__)), "api", "static", "examples")
SEED = 2024
NUM_IMAGES = 3  # one scene of each size: 1, 2 and 3 shapes
IMAGE_SIDE = 160  # small files; the processor maps every square picture to the same token grid anyway
CLIP_FRAMES = 8
LIVE_CLIP_FRAMES = 16  # one pass of the shape across the frame; the page loops it
LIVE_CLIP_FPS = 4


def _clean_style(style: world.Style) -> world.Style:
    """The scene's style without blur, noise or JPEG artefacts (the examples should look like what they are)."""
    return world.Style(supersample=4, resample=style.resample, blur=0.0, noise=0.0, jpeg_quality=0, seed=style.seed)


def _scaled(scene: world.Scene, side: int) -> world.Scene:
    """The scene redrawn on a `side`-pixel square (shape centers and radii scaled with it)."""
    f = side / scene.width
    shapes = tuple(
        world.Shape(s.kind, s.color, s.place, s.cx * f, s.cy * f, s.r * f, s.rotation, s.fill) for s in scene.shapes
    )
    return world.Scene(side, side, scene.background, shapes, _clean_style(scene.style))


def example_scenes(seed: int = SEED) -> list[world.Scene]:
    """NUM_IMAGES still scenes with 1, 2, ... shapes on solid or gradient backgrounds, clean and IMAGE_SIDE px."""
    rng = random.Random(seed)
    scenes = []
    for n in range(1, NUM_IMAGES + 1):
        scene = world.sample_scene(rng, n)
        while scene.background.kind == "noise":
            scene = world.sample_scene(rng, n)
        scenes.append(_scaled(scene, IMAGE_SIDE))
    return scenes


def example_clip(seed: int = SEED) -> world.VideoScene:
    """One clean clip of CLIP_FRAMES frames on a solid background."""
    rng = random.Random(seed + 1)
    clip = world.sample_video(rng, CLIP_FRAMES)
    while clip.background.kind == "noise":
        clip = world.sample_video(rng, CLIP_FRAMES)
    return world.VideoScene(
        clip.width, clip.height, clip.background, clip.shape, clip.direction, clip.centers, _clean_style(clip.style)
    )


def live_clip(seed: int = SEED) -> world.VideoScene:
    """Live mode's clip: a clean clip of LIVE_CLIP_FRAMES frames on a solid background."""
    rng = random.Random(seed + 2)
    clip = world.sample_video(rng, LIVE_CLIP_FRAMES)
    while clip.background.kind == "noise":
        clip = world.sample_video(rng, LIVE_CLIP_FRAMES)
    return world.VideoScene(
        clip.width, clip.height, clip.background, clip.shape, clip.direction, clip.centers, _clean_style(clip.style)
    )


def write_webm(frames: list, path: str, fps: int) -> str:
    """Encode PIL frames as a VP8 WebM with PyAV (sides rounded down to even numbers); return path."""
    return world.write_clip(frames, path, fps, "libvpx", "webm", {"crf": "8", "b": "400k", "threads": "1"})


def write_live_clip(out: str = DEFAULT_OUT, seed: int = SEED) -> dict:
    """Render live mode's clip into `out` as live_demo.webm and write live_demo.json; return its entry."""
    clip = live_clip(seed)
    write_webm(world.render_video(clip), os.path.join(out, "live_demo.webm"), LIVE_CLIP_FPS)
    entry = {"file": "live_demo.webm", "mime": "video/webm", "fps": LIVE_CLIP_FPS, "questions": _questions(clip)}
    with open(os.path.join(out, "live_demo.json"), "w") as f:
        json.dump(entry, f, indent=1)
        f.write("\n")
    return entry


def _questions(scene: world.Scene | world.VideoScene) -> list[dict[str, str]]:
    return [{"form": form, "question": q, "answer": a} for form, q, a in world.qas(scene)]


def write_examples(out: str = DEFAULT_OUT, seed: int = SEED) -> list[dict]:
    """Render the examples into `out` and write examples.json (and live mode's clip); return examples.json's
    entries."""
    os.makedirs(out, exist_ok=True)
    entries = []
    for i, scene in enumerate(example_scenes(seed), start=1):
        name = f"img{i}.png"
        world.render_image(scene).save(os.path.join(out, name), optimize=True)
        entries.append({"file": name, "kind": "image", "mime": "image/png", "questions": _questions(scene)})
    clip = example_clip(seed)
    world.write_mp4(world.render_video(clip), os.path.join(out, "clip1.mp4"))
    entries.append({"file": "clip1.mp4", "kind": "video", "mime": "video/mp4", "questions": _questions(clip)})
    with open(os.path.join(out, "examples.json"), "w") as f:
        json.dump(entries, f, indent=1)
        f.write("\n")
    write_live_clip(out, seed)
    return entries


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for entry in write_examples(args.out):
        description = next(q["answer"] for q in entry["questions"] if q["form"].startswith("describe"))
        print(f"{entry['file']}: {description}")
    live = json.load(open(os.path.join(args.out, "live_demo.json")))
    print(f"{live['file']}: {next(q['answer'] for q in live['questions'] if q['form'] == 'describe_video')}")


if __name__ == "__main__":
    main()
