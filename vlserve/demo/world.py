"""The demo model's synthetic world: scenes of colored shapes, their renderings, and every question form with its
deterministic answer.

Images hold 1-3 shapes of distinct kinds (circle, square, triangle) in 8 colors, each in its own place (left, right,
top, bottom or center), on a solid, gradient or noisy background; square, 64-448 px a side (square images all map
to the same visual-token grid, which keeps positions simple for a model this small). Videos hold one shape
moving left, right, up or down over 4-16 frames. A scene fixes everything a rendering needs (including its
anti-aliasing style and noise seed), so `render_image(scene)` / `render_video(scene)` are deterministic.
"""

from __future__ import annotations

import io
import json
import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SHAPES = ("circle", "square", "triangle")
COLORS = {
    "red": (220, 35, 35),
    "green": (30, 170, 50),
    "blue": (35, 70, 225),
    "yellow": (245, 220, 30),
    "purple": (140, 50, 185),
    "orange": (250, 140, 20),
    "white": (250, 250, 250),
    "black": (12, 12, 12),
}
PLACES = ("left", "right", "top", "bottom", "center")
PLACE_XY = {"left": (0.18, 0.5), "right": (0.82, 0.5), "top": (0.5, 0.18), "bottom": (0.5, 0.82), "center": (0.5, 0.5)}
PLACE_JITTER = 0.02  # max offset of a shape center from its place, as a fraction of the side
SHAPE_RADIUS = (0.10, 0.13)  # nominal radius range, fraction of the side (large enough to tell a circle from a square)
# Video frames reach the model at 112x112 px (4x4 tokens a frame pair; images get 168x168), so clips draw the shape
# larger than a still's (21-26 px radius in processed pixels): smaller, circles and squares blur.
VIDEO_SHAPE_RADIUS = (0.19, 0.23)
VIDEO_MARGIN = 0.28  # nearest a clip's shape center comes to the frame's edge, fraction of the side
# Farthest the shape moves from one frame to the next, fraction of the side. The vision tower sees frames in pairs
# (one Conv3d patch spans two frames): a longer step would show it two shapes side by side instead of one.
VIDEO_MAX_STEP = 0.06
DIRECTIONS = ("left", "right", "up", "down")
DIRECTION_XY = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}

# "json" (the picture described as JSON, see json_answer) is an image form, but last in FORMS (after the video
# forms), so that the other forms keep their indices and a seeded held-out set (held_out.held_out_set walks FORMS
# in order) keeps its items.
IMAGE_FORMS = ("shape", "color", "count", "where", "describe", "json")
VIDEO_FORMS = ("direction", "moving_color", "describe_video")
FORMS = ("shape", "color", "count", "where", "describe", "direction", "moving_color", "describe_video", "json")
QUESTION_TEMPLATES = {
    "shape": "What shape is in the image?",
    "color": "What color is the {shape}?",
    "count": "How many shapes are there?",
    "where": "Where is the {color} {shape}?",
    "describe": "Describe the image.",
    "direction": "Which direction does the {shape} move?",
    "moving_color": "What color is the moving shape?",
    "describe_video": "Describe the video.",
    "json": "Describe the image as JSON.",
}
# What a "json" answer fits: {"count": N, "shapes": [{"shape": KIND, "color": COLOR}, ...]} (json_answer's object).
DEMO_JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer"},
        "shapes": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "shape": {"type": "string", "enum": list(SHAPES)},
                    "color": {"type": "string", "enum": list(COLORS)},
                },
                "required": ["shape", "color"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["count", "shapes"],
    "additionalProperties": False,
}
MIN_SIDE, MAX_SIDE = 64, 448
MAX_VIDEO_SIDE = 256  # frames are processed at ~100 px anyway
MIN_FRAMES, MAX_FRAMES = 4, 16
RESAMPLE = (Image.NEAREST, Image.BILINEAR, Image.BOX, Image.BICUBIC, Image.LANCZOS)


@dataclass(frozen=True)
class Style:
    """How a scene is drawn: supersampling factor, downsampling filter, blur, pixel noise, JPEG round trip."""

    supersample: int
    resample: int
    blur: float
    noise: float
    jpeg_quality: int  # 0 = no JPEG round trip
    seed: int


@dataclass(frozen=True)
class Background:
    """kind is "solid", "gradient" or "noise"; colors are RGB; angle (radians) orients a gradient."""

    kind: str
    color_a: tuple[int, int, int]
    color_b: tuple[int, int, int]
    angle: float


@dataclass(frozen=True)
class Shape:
    """One shape: kind, color name, place name; center (cx, cy) and radius r in pixels; rotation in degrees; fill
    is the exact RGB drawn (the named color, jittered)."""

    kind: str
    color: str
    place: str
    cx: float
    cy: float
    r: float
    rotation: float
    fill: tuple[int, int, int]


@dataclass(frozen=True)
class Scene:
    """A still image: its size, background, shapes (sorted by kind) and drawing style."""

    width: int
    height: int
    background: Background
    shapes: tuple[Shape, ...]
    style: Style


@dataclass(frozen=True)
class VideoScene:
    """A clip of one shape moving in `direction`: its per-frame centers, size, background and style."""

    width: int
    height: int
    background: Background
    shape: Shape  # cx, cy: the first frame's center; place is unused ("")
    direction: str
    centers: tuple[tuple[float, float], ...]
    style: Style

    @property
    def num_frames(self) -> int:
        """Number of frames in the clip."""
        return len(self.centers)


# ------------------------------------------------------------------------------------------------- sampling
def _sample_size(rng: random.Random, max_side: int = MAX_SIDE) -> tuple[int, int]:
    side = rng.randint(MIN_SIDE, max_side)  # square: the processor maps every size to the same token grid
    return side, side


def _sample_style(rng: random.Random, w: int, h: int) -> Style:
    k = min(rng.choice((1, 1, 2, 3, 4)), max(1, 1024 // max(w, h)))  # supersampled canvas <= 1024 px
    return Style(
        supersample=k,
        resample=rng.choice(RESAMPLE),
        blur=rng.choice((0.0, 0.0, 0.0, rng.uniform(0.3, 1.2))),
        noise=rng.choice((0.0, 0.0, rng.uniform(2.0, 12.0))),
        jpeg_quality=rng.choice((0, 0, 0, rng.randint(45, 95))),
        seed=rng.getrandbits(31),
    )


def _far_color(rng: random.Random, avoid: list[tuple[int, int, int]], min_dist: float = 110.0):
    """A random RGB color at least min_dist (Euclidean) from every color in `avoid`."""
    while True:
        c = tuple(rng.randint(0, 255) for _ in range(3))
        if all(math.dist(c, a) >= min_dist for a in avoid):
            return c


def _sample_background(rng: random.Random, shape_colors: list[str]) -> Background:
    avoid = [COLORS[c] for c in shape_colors]
    kind = rng.choice(("solid", "solid", "gradient", "noise"))
    a = _far_color(rng, avoid)
    b = a
    if kind == "gradient":  # the midpoint must stay far from the shapes too
        while True:
            b = _far_color(rng, avoid)
            mid = tuple((x + y) / 2 for x, y in zip(a, b))
            if all(math.dist(mid, c) >= 90 for c in avoid):
                break
    return Background(kind, a, b, rng.uniform(0, 2 * math.pi))


def _jitter_color(rng: random.Random, name: str, amount: int = 22) -> tuple[int, int, int]:
    return tuple(min(255, max(0, v + rng.randint(-amount, amount))) for v in COLORS[name])


def _bound(kind: str, r: float) -> float:
    """Radius of the circle enclosing a shape of nominal radius r (see _shape_polygon)."""
    return r * (1.0 if kind == "circle" else 0.85 * math.sqrt(2) if kind == "square" else 1.1)


def sample_scene(rng: random.Random, num_shapes: int | None = None) -> Scene:
    """A random still scene: 1-3 shapes of distinct kinds, distinct colors and distinct places, not overlapping."""
    n = num_shapes or rng.randint(1, 3)
    w, h = _sample_size(rng)
    kinds = sorted(rng.sample(SHAPES, n), key=SHAPES.index)
    colors = rng.sample(list(COLORS), n)
    places = rng.sample(PLACES, n)
    side = min(w, h)
    while True:
        shapes = []
        for kind, color, place in zip(kinds, colors, places):
            px, py = PLACE_XY[place]
            shapes.append(
                Shape(
                    kind,
                    color,
                    place,
                    (px + rng.uniform(-PLACE_JITTER, PLACE_JITTER)) * w,
                    (py + rng.uniform(-PLACE_JITTER, PLACE_JITTER)) * h,
                    rng.uniform(*SHAPE_RADIUS) * side,
                    rng.uniform(-20, 20),
                    _jitter_color(rng, color),
                )
            )
        if all(
            math.dist((a.cx, a.cy), (b.cx, b.cy)) >= _bound(a.kind, a.r) + _bound(b.kind, b.r) + 0.02 * side
            for i, a in enumerate(shapes)
            for b in shapes[i + 1 :]
        ):
            break
    return Scene(w, h, _sample_background(rng, colors), tuple(shapes), _sample_style(rng, w, h))


def sample_video(rng: random.Random, num_frames: int | None = None) -> VideoScene:
    """A random clip: one shape moving in one direction over 4-16 frames, across 18-44% of the frame's side (at most
    VIDEO_MAX_STEP a frame)."""
    t = num_frames or rng.randint(MIN_FRAMES, MAX_FRAMES)
    w, h = _sample_size(rng, MAX_VIDEO_SIDE)
    kind, color, direction = rng.choice(SHAPES), rng.choice(list(COLORS)), rng.choice(DIRECTIONS)
    side = min(w, h)
    r = rng.uniform(*VIDEO_SHAPE_RADIUS) * side
    dx, dy = DIRECTION_XY[direction]
    dist = min(rng.uniform(0.25, 1 - 2 * VIDEO_MARGIN), VIDEO_MAX_STEP * (t - 1))
    # Along the motion axis: start on the trailing side (mirrored for left/up); across it: the middle band.
    lo = max(VIDEO_MARGIN, 0.5 - dist / 2 - 0.08)
    start = rng.uniform(lo, min(1 - VIDEO_MARGIN - dist, 0.5 - dist / 2 + 0.08))
    across = rng.uniform(0.3, 0.7)
    along = start if dx + dy > 0 else 1 - start
    sx, sy = (along, across) if dx else (across, along)
    centers = tuple(((sx + dx * dist * i / (t - 1)) * w, (sy + dy * dist * i / (t - 1)) * h) for i in range(t))
    shape = Shape(kind, color, "", centers[0][0], centers[0][1], r, rng.uniform(-20, 20), _jitter_color(rng, color))
    return VideoScene(w, h, _sample_background(rng, [color]), shape, direction, centers, _sample_style(rng, w, h))


# ------------------------------------------------------------------------------------------------ rendering
def _background_array(bg: Background, w: int, h: int, rng: np.random.Generator) -> np.ndarray:
    """-> uint8 [h, w, 3]."""
    a = np.array(bg.color_a, np.float32)
    if bg.kind == "gradient":
        ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)  # [h, w] each
        proj = (xs / w - 0.5) * math.cos(bg.angle) + (ys / h - 0.5) * math.sin(bg.angle)
        t = np.clip(proj + 0.5, 0, 1)[..., None]  # [h, w, 1]
        arr = a * (1 - t) + np.array(bg.color_b, np.float32) * t  # [h, w, 3]
    else:
        arr = np.broadcast_to(a, (h, w, 3)).copy()
    if bg.kind == "noise":
        arr = arr + rng.normal(0, 18, size=(h, w, 3))
    return np.clip(arr, 0, 255).astype(np.uint8)


def _shape_polygon(kind: str, cx: float, cy: float, r: float, rotation: float) -> list[tuple[float, float]]:
    if kind == "square":
        s = 0.85 * r
        pts = [(-s, -s), (s, -s), (s, s), (-s, s)]
    else:  # triangle, apex up, centroid at the center
        R = 1.1 * r
        pts = [(R * math.cos(math.radians(a)), R * math.sin(math.radians(a))) for a in (-90, 30, 150)]
    c, s_ = math.cos(math.radians(rotation)), math.sin(math.radians(rotation))
    return [(cx + x * c - y * s_, cy + x * s_ + y * c) for x, y in pts]


def _draw_shape(draw: ImageDraw.ImageDraw, sh: Shape, cx: float, cy: float, k: int) -> None:
    """Draw sh centered at (cx, cy) (base pixels) on a canvas supersampled k times."""
    if sh.kind == "circle":
        draw.ellipse([k * (cx - sh.r), k * (cy - sh.r), k * (cx + sh.r), k * (cy + sh.r)], fill=sh.fill)
    else:
        draw.polygon([(k * x, k * y) for x, y in _shape_polygon(sh.kind, cx, cy, sh.r, sh.rotation)], fill=sh.fill)


def _finish(img: Image.Image, w: int, h: int, style: Style, rng: np.random.Generator) -> Image.Image:
    """Downsample a supersampled canvas and apply blur / noise / JPEG."""
    if img.size != (w, h):
        img = img.resize((w, h), style.resample)
    if style.blur:
        img = img.filter(ImageFilter.GaussianBlur(style.blur))
    if style.noise:
        arr = np.asarray(img, np.float32) + rng.normal(0, style.noise, size=(h, w, 3))  # [h, w, 3]
        img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    if style.jpeg_quality:
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=style.jpeg_quality)
        img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    return img


def _canvas(bg_arr: np.ndarray, k: int) -> Image.Image:
    img = Image.fromarray(bg_arr)
    return img if k == 1 else img.resize((img.width * k, img.height * k), Image.BILINEAR)


def render_image(scene: Scene) -> Image.Image:
    """The scene as an RGB PIL image of size (scene.width, scene.height)."""
    rng = np.random.default_rng(scene.style.seed)
    k = scene.style.supersample
    img = _canvas(_background_array(scene.background, scene.width, scene.height, rng), k)
    draw = ImageDraw.Draw(img)
    for sh in scene.shapes:
        _draw_shape(draw, sh, sh.cx, sh.cy, k)
    return _finish(img, scene.width, scene.height, scene.style, rng)


def render_video(scene: VideoScene) -> list[Image.Image]:
    """The clip as a list of RGB PIL frames (same size, same background)."""
    rng = np.random.default_rng(scene.style.seed)
    k = scene.style.supersample
    bg = _canvas(_background_array(scene.background, scene.width, scene.height, rng), k)
    frames = []
    for cx, cy in scene.centers:
        img = bg.copy()
        _draw_shape(ImageDraw.Draw(img), scene.shape, cx, cy, k)
        frames.append(_finish(img, scene.width, scene.height, scene.style, rng))
    return frames


def write_mp4(frames: list[Image.Image], path: str, fps: int = 4) -> str:
    """Encode frames as an H.264 mp4 with PyAV (sides rounded down to even numbers); return path."""
    return write_clip(frames, path, fps, "libx264", None, {"crf": "18"})


def write_clip(
    frames: list[Image.Image], path: str, fps: int, codec: str, container_format: str | None, options: dict
) -> str:
    """Encode frames with PyAV's `codec` (yuv420p, sides rounded down to even numbers, encoder `options`) into
    `path` (`container_format`, or the one its extension names); return path."""
    import av

    w, h = frames[0].width // 2 * 2, frames[0].height // 2 * 2
    with av.open(path, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = options
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_image(f.crop((0, 0, w, h)))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


# ---------------------------------------------------------------------------------------- questions/answers
def _a(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _article_list(items: list[str]) -> str:
    items = [_a(x) for x in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def describe_image(scene: Scene) -> str:
    """The description: every shape with its color and place, shapes in circle/square/triangle order."""
    n = len(scene.shapes)
    parts = _article_list([f"{s.color} {s.kind} at the {s.place}" for s in scene.shapes])
    return f"The image shows {n} shape{'s' if n > 1 else ''}: {parts}."


def json_answer(scene: Scene) -> str:
    """The "json" form's answer: `json.dumps` (default separators) of {"count": N, "shapes": [{"shape", "color"}, ...]},
    the shapes in describe_image's order."""
    return json.dumps(
        {"count": len(scene.shapes), "shapes": [{"shape": s.kind, "color": s.color} for s in scene.shapes]}
    )


def _fits(value, schema: dict) -> bool:
    """A small JSON-schema check covering what DEMO_JSON_SCHEMA uses (type, properties, required,
    additionalProperties false, items, enum); used when the jsonschema package is not installed."""
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict) or any(k not in value for k in schema.get("required", ())):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties", True) is False and any(k not in props for k in value):
            return False
        return all(_fits(value[k], sub) for k, sub in props.items() if k in value)
    if kind == "array":
        return isinstance(value, list) and all(_fits(v, schema.get("items", {})) for v in value)
    if kind == "integer" and (not isinstance(value, int) or isinstance(value, bool)):
        return False
    if kind == "string" and not isinstance(value, str):
        return False
    return "enum" not in schema or value in schema["enum"]


def fits_json_schema(text: str, schema: dict | None = None) -> bool:
    """Whether `text` parses as JSON and the value fits `schema` (default DEMO_JSON_SCHEMA): with the jsonschema
    package where installed, else with a small checker of the keywords DEMO_JSON_SCHEMA uses."""
    schema = DEMO_JSON_SCHEMA if schema is None else schema
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return _fits(value, schema)
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def image_qas(scene: Scene) -> list[tuple[str, str, str]]:
    """Every question the scene supports, as (form, question, answer)."""
    n = len(scene.shapes)
    kinds = [s.kind for s in scene.shapes]
    shape_ans = f"It is {_a(kinds[0])}." if n == 1 else f"There are {_article_list(kinds)}."
    count_ans = "There is 1 shape." if n == 1 else f"There are {n} shapes."
    qas = [
        ("shape", QUESTION_TEMPLATES["shape"], shape_ans),
        ("count", QUESTION_TEMPLATES["count"], count_ans),
        ("describe", QUESTION_TEMPLATES["describe"], describe_image(scene)),
    ]
    for s in scene.shapes:
        qas.append(("color", QUESTION_TEMPLATES["color"].format(shape=s.kind), f"The {s.kind} is {s.color}."))
        qas.append(
            (
                "where",
                QUESTION_TEMPLATES["where"].format(color=s.color, shape=s.kind),
                f"The {s.color} {s.kind} is at the {s.place}.",
            )
        )
    qas.append(("json", QUESTION_TEMPLATES["json"], json_answer(scene)))
    return qas


def video_qas(scene: VideoScene) -> list[tuple[str, str, str]]:
    """Every question the clip supports, as (form, question, answer)."""
    s = scene.shape
    return [
        ("direction", QUESTION_TEMPLATES["direction"].format(shape=s.kind), f"The {s.kind} moves {scene.direction}."),
        ("moving_color", QUESTION_TEMPLATES["moving_color"], f"The moving shape is {s.color}."),
        (
            "describe_video",
            QUESTION_TEMPLATES["describe_video"],
            f"The video shows {_a(s.color)} {s.kind} that moves {scene.direction} across the frame.",
        ),
    ]


def qas(scene: Scene | VideoScene) -> list[tuple[str, str, str]]:
    """image_qas or video_qas, by scene type."""
    return video_qas(scene) if isinstance(scene, VideoScene) else image_qas(scene)


def sample_qa(rng: random.Random, scene: Scene | VideoScene, form: str | None = None) -> tuple[str, str, str]:
    """One (form, question, answer): a uniformly chosen form (or the given one), then a uniform instance of it."""
    all_qas = qas(scene)
    form = form or rng.choice(sorted({f for f, _, _ in all_qas}))
    return rng.choice([qa for qa in all_qas if qa[0] == form])


def answer(scene: Scene | VideoScene, question: str) -> str:
    """The answer to `question` (one of the supported forms, exact text) about `scene`; ValueError otherwise."""
    for _, q, a in qas(scene):
        if q == question.strip():
            return a
    raise ValueError(f"unsupported question for this scene: {question!r}")
