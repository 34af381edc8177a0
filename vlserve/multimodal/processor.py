"""Turns a tokenized prompt with `<|image_pad|>` / `<|video_pad|>` / `<|AUDIO|>` placeholders plus raw media into the
expanded prompt and one MultiModalFeature per media item, using the checkpoint's own HF processor (Qwen2-VL /
Qwen2.5-VL; Qwen2-Audio, whose per-clip work lives in audio.py; Qwen3-VL and InternVL, whose videos become one
feature per frame (pair), see qwen3_vl_video.py and internvl_items.py).

Each item is loaded (media.py), hashed (hashing.py) and run through the HF image / video processor on its own, so
results can be cached per item: a repeated image (same pixels, same kwargs) skips the HF processor entirely.
The image processor is the torchvision-backed ("fast") one where transformers has one (`use_fast=False`: the
PIL / numpy one). Several threads may process items at once (the server's preprocessing pool).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vlserve.multimodal import video_pruning as pruning
from vlserve.multimodal.audio import AudioItemProcessor, audio_tokens
from vlserve.multimodal.gemma3_items import gemma3_items_for
from vlserve.multimodal.hashing import hash_mm_item, hash_named_item
from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.multimodal.llava_items import image_items_for
from vlserve.multimodal.media import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_VIDEO_FRAMES,
    LoadedVideo,
    load_image,
    load_video,
)
from vlserve.multimodal.media_refs import ImageEmbeds, NamedItem
from vlserve.multimodal.perception_lm import family_items
from vlserve.multimodal.qwen3_vl_video import Qwen3VLVideos, is_qwen3_vl_processor
from vlserve.multimodal.video_frame_size import DEFAULT_MAX_VIDEO_FRAME_PIXELS, video_frame_size
from vlserve.shorten import shorten

# mm_processor_kwargs consumed by our own frame sampling (load_video), not by the HF processors.
VIDEO_SAMPLING_KEYS = ("fps", "num_frames", "max_frames")
# mm_processor_kwargs read once, when the processor is loaded (`--mm-processor-kwargs '{"use_fast": false}'`).
LOAD_TIME_KEYS = ("use_fast",)
DEFAULT_VIDEO_FPS = 2.0  # what the HF Qwen2.5-VL processor assumes when no fps is known

logger = logging.getLogger(__name__)


def wants_fast_processor(mm_processor_kwargs: dict | None) -> bool:
    """`use_fast` of the server's mm_processor_kwargs (default True: the torchvision-backed image processor;
    EngineArgs checks that it is a bool)."""
    return bool((mm_processor_kwargs or {}).get("use_fast", True))


def is_fast_image_processor(image_processor: Any) -> bool:
    """Whether an HF image processor is torchvision-backed (4.x: `*ImageProcessorFast`; 5.x: the default classes,
    the PIL ones being `*ImageProcessorPil`)."""
    try:
        from transformers.image_processing_backends import TorchvisionBackend as FastBase  # transformers 5.x
    except ImportError:
        from transformers.image_processing_utils_fast import BaseImageProcessorFast as FastBase  # 4.x
    return isinstance(image_processor, FastBase)


def load_hf_processor(model_dir: str, use_fast: bool = True) -> Any:
    """The checkpoint's AutoProcessor from a local directory (never the hub), its image processor swapped for the
    fast or slow class as asked when transformers picked the other (4.57 picks the class the checkpoint was saved
    with, 5.x torchvision). A family with one class only (PerceptionLM: torchvision) keeps it."""
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor

    hf_processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    current = getattr(hf_processor, "image_processor", None)
    if current is None or is_fast_image_processor(current) == use_fast:
        return hf_processor
    if int(transformers.__version__.split(".")[0]) >= 5:
        backend = {"backend": "torchvision" if use_fast else "pil"}  # 5.x deprecates use_fast
    else:
        backend = {"use_fast": use_fast}
    try:
        other = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True, **backend)
    except ValueError:  # 4.57, a family with no class of that kind ("does not have a slow version")
        other = None
    if other is not None and is_fast_image_processor(other) == use_fast:
        hf_processor.image_processor = other
    else:
        logger.info(
            "%s has no %s image processor; keeping %s",
            model_dir,
            "fast" if use_fast else "slow",
            type(current).__name__,
        )
    return hf_processor


def _last_line(error: Exception) -> str:
    """The last line of a processor's error message, cut short (5.x puts the field's rule there, after a heading)."""
    lines = str(error).strip().splitlines()
    return (lines[-1] if lines else type(error).__name__)[:200]


class MultiModalProcessor:
    """Per-item HF processing with an LRU cache keyed by mm_hash, and placeholder expansion.

    `hf_processor` is the checkpoint's AutoProcessor (Qwen2VLProcessor / Qwen2_5_VLProcessor): it provides the
    image processor, the video processor, the tokenizer and the placeholder token ids (`image_token_id` overrides
    the image one: the model config's). PerceptionLM and LLaVA-family processors get their per-image rules from
    `perception_lm` / `llava_items` (`self.family`; None for Qwen, whose outputs carry grids); Qwen3-VL videos
    become one feature per temporal grid step (`qwen3_vl_video`). The cache holds at most
    `cache_size` items and `cache_max_bytes` bytes of processed tensors (0 disables it). Thread-safe: the cache and
    its counters sit behind a lock, and a thread asking for an item another thread is processing waits for that
    result (a hit) instead of running the HF processor again.
    """

    def __init__(
        self,
        hf_processor: Any,
        cache_size: int = 256,
        cache_max_bytes: int = 1 << 30,
        max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
        max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
        max_video_frame_pixels: int | None = DEFAULT_MAX_VIDEO_FRAME_PIXELS,
        max_audio_seconds: float | None = None,
        image_token_id: int | None = None,
    ):
        self.hf_processor = hf_processor
        self.image_processor = getattr(hf_processor, "image_processor", None)
        self.video_processor = getattr(hf_processor, "video_processor", None)
        self.tokenizer = hf_processor.tokenizer
        self.image_token_id: int | None = (
            getattr(hf_processor, "image_token_id", None) if image_token_id is None else image_token_id
        )
        self.video_token_id: int | None = getattr(hf_processor, "video_token_id", None)
        self.audio_token_id: int | None = getattr(hf_processor, "audio_token_id", None)
        extractor = getattr(hf_processor, "feature_extractor", None)
        self.audio_processor = (
            None
            if extractor is None or self.audio_token_id is None
            else AudioItemProcessor(extractor, max_audio_seconds)
        )
        # A family's own per-image processing (tiling, placeholder counts: PerceptionLM, LLaVA-1.5 / NeXT);
        # None = Qwen2-VL's grid rules below.
        self.family = family_items(hf_processor) or image_items_for(hf_processor) or gemma3_items_for(hf_processor)
        if hasattr(self.family, "placeholder_token_id"):  # Gemma 3's `<start_of_image>`, whatever HF's names
            self.image_token_id = self.family.placeholder_token_id
        if self.video_token_id is None:  # InternVLProcessor names its `<video>` token only as text
            self.video_token_id = getattr(self.family, "video_token_id", None)
        # Qwen3-VL: a video becomes per-frame placeholder runs with timestamp text between them (qwen3_vl_video)
        self.qwen3_videos = (
            Qwen3VLVideos(hf_processor)
            if self.video_processor is not None and is_qwen3_vl_processor(hf_processor)
            else None
        )
        # whoever spells a video out as per-frame runs with text between them (`expand_video`): Qwen3-VL, InternVL
        self.video_expander = self.qwen3_videos or (
            self.family if hasattr(self.family, "expand_video") and self.video_processor is not None else None
        )
        # modality -> its placeholder token text, for the modalities this checkpoint has
        self.placeholders = {
            m: self.tokenizer.convert_ids_to_tokens(t)
            for m, t in (("image", self.image_token_id), ("video", self.video_token_id), ("audio", self.audio_token_id))
            if t is not None
        }
        self.cache_size = cache_size
        self.cache_max_bytes = cache_max_bytes
        self._cache_bytes = 0
        self.max_image_pixels = max_image_pixels
        self.max_video_frames = max_video_frames
        self.max_video_frame_pixels = (
            max_video_frame_pixels  # decoded frames above it are scaled down (see _load_video)
        )
        self._cache: OrderedDict[str, dict] = OrderedDict()  # mm_hash -> processed data (tensors)
        self._in_flight: dict[str, Future] = {}  # mm_hash -> the result another thread is computing
        self._lock = threading.Lock()  # guards the two dicts above, _cache_bytes and the counters
        self.cache_hits = 0
        self.cache_misses = 0

    @classmethod
    def from_pretrained(cls, model_dir: str, use_fast: bool = True, **kwargs: Any) -> MultiModalProcessor:
        """Load the checkpoint's HF processor from a local directory (never the hub) and wrap it; `use_fast`: the
        torchvision-backed image processor where transformers has one (see `load_hf_processor`)."""
        return cls(load_hf_processor(model_dir, use_fast), **kwargs)

    # ----------------------------------------------------------------------------------------------- kwargs
    @staticmethod
    def _split_kwargs(mm_kwargs: dict | None) -> tuple[dict, dict, dict]:
        """-> (image processor kwargs, video processor kwargs, video sampling kwargs)."""
        mm_kwargs = {k: v for k, v in (mm_kwargs or {}).items() if k not in LOAD_TIME_KEYS}
        sampling = {k: mm_kwargs.pop(k) for k in VIDEO_SAMPLING_KEYS if k in mm_kwargs}
        sampling = {k: v for k, v in sampling.items() if v is not None}  # None: a request unset a server default
        return dict(mm_kwargs), dict(mm_kwargs), sampling

    def _video_hf_kwargs(self, video_kwargs: dict) -> dict:
        """The HF video processor reads its pixel bounds only from `size`: translate min/max_pixels into it."""
        kw = dict(video_kwargs)
        lo, hi = kw.pop("min_pixels", None), kw.pop("max_pixels", None)
        if lo is not None or hi is not None:
            size = dict(kw.get("size") or self.video_processor.size)
            if lo is not None:
                size["shortest_edge"] = lo
            if hi is not None:
                size["longest_edge"] = hi
            kw["size"] = size
        return kw

    def _merge_size(self, modality: str) -> int:
        proc = self.image_processor if modality == "image" else self.video_processor
        return int(getattr(proc, "merge_size", 2))

    # ----------------------------------------------------------------------------------------------- cache
    def _get_or_compute(self, mm_hash: str, compute: Callable[[], dict]) -> dict:
        """The cached data of `mm_hash` (a hit), else `compute()` run once (a miss) and stored; a thread that asks
        while another computes the same item waits for its result (a hit; or its error)."""
        with self._lock:
            data = self._cache.get(mm_hash)
            if data is not None:
                self._cache.move_to_end(mm_hash)
                self.cache_hits += 1
                return data
            pending = self._in_flight.get(mm_hash)
            if pending is None:
                self.cache_misses += 1
                self._in_flight[mm_hash] = owned = Future()
        if pending is not None:
            data = pending.result()
            with self._lock:
                self.cache_hits += 1
            return data
        try:
            data = compute()
        except BaseException as e:
            with self._lock:
                del self._in_flight[mm_hash]
            owned.set_exception(e)
            raise
        with self._lock:
            self._store(mm_hash, data)
            del self._in_flight[mm_hash]
        owned.set_result(data)
        return data

    @staticmethod
    def _nbytes(data: dict) -> int:
        return sum(v.numel() * v.element_size() for v in data.values() if hasattr(v, "element_size"))

    def _store(self, mm_hash: str, data: dict) -> None:
        """Keep `data` (the caller holds the lock), evicting the least recently used beyond the bounds."""
        size = self._nbytes(data)
        if self.cache_size <= 0 or size > self.cache_max_bytes or mm_hash in self._cache:
            return
        self._cache[mm_hash] = data
        self._cache_bytes += size
        while len(self._cache) > self.cache_size or self._cache_bytes > self.cache_max_bytes:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= self._nbytes(old)

    def clear_cache(self) -> None:
        """Drop all cached processor outputs."""
        with self._lock:
            self._cache.clear()
            self._cache_bytes = 0

    # ----------------------------------------------------------------------------------------------- items
    def process_image(self, image: Any, image_kwargs: dict | None = None) -> tuple[str, dict]:
        """Load, hash and (on a cache miss) run the HF image processor on one image -> (mm_hash, data).

        data = {"pixel_values": float [grid_t*grid_h*grid_w, C*temporal_patch*patch*patch],
                "image_grid_thw": int64 [1, 3]} for Qwen; LLaVA's: see llava_items.
        """
        image_kwargs = image_kwargs or {}
        if isinstance(image, ImageEmbeds):  # precomputed embeddings: nothing to process or cache
            return image.mm_hash, image.data()
        if isinstance(image, NamedItem):  # keyed by the client's name; without media, only a cached item serves
            mm_hash = hash_named_item("image", image.uuid, image_kwargs)
            load = lambda: load_image(image.require_media("image"), max_pixels=self.max_image_pixels)  # noqa: E731
            return mm_hash, self._get_or_compute(mm_hash, lambda: self._run_image(load(), image_kwargs))
        img = load_image(image, max_pixels=self.max_image_pixels)
        mm_hash = hash_mm_item("image", img, image_kwargs)
        return mm_hash, self._get_or_compute(mm_hash, lambda: self._run_image(img, image_kwargs))

    def _run_image(self, img: Any, image_kwargs: dict) -> dict:
        try:
            kwargs = {**_layout_kwargs(img), **image_kwargs}
            if self.family is not None:
                return self.family.run_image(_unambiguous(img), kwargs)
            out = self.image_processor(images=[_unambiguous(img)], return_tensors="pt", **kwargs)
            return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        except Exception as e:  # bad kwargs (5.x: huggingface_hub's strict-field errors) or unprocessable shapes
            raise ValueError(
                f"image processing failed (mm_processor_kwargs={shorten(image_kwargs)}): {_last_line(e)}"
            ) from None

    def process_video(
        self, video: Any, video_kwargs: dict | None = None, sampling_kwargs: dict | None = None
    ) -> tuple[str, dict]:
        """Load/sample, hash and (on a cache miss) run the HF video processor on one video -> (mm_hash, data).

        data = {"pixel_values_videos": float [grid_t*grid_h*grid_w, C*temporal_patch*patch*patch],
                "video_grid_thw": int64 [1, 3], "second_per_grid_ts": float32 [1]}; second_per_grid_ts is
        temporal_patch_size / sampled fps (2.0 fps assumed when the video's rate is unknown, like HF). Qwen3-VL
        adds "timestamp_fps" and "frame_indices" (see qwen3_vl_video.Qwen3VLVideos.timing); InternVL's: see
        internvl_items.
        """
        if self.video_processor is None:
            raise ValueError("this model's processor has no video processor; videos are not supported")
        video_kwargs, sampling = video_kwargs or {}, dict(sampling_kwargs or {})
        max_frames = int(sampling.pop("max_frames", self.max_video_frames))
        if isinstance(video, NamedItem):  # as for images: the key is the name and every kwarg, sampling included
            mm_hash = hash_named_item("video", video.uuid, {**video_kwargs, **sampling, "max_frames": max_frames})
            load = lambda: self._load_video(video.require_media("video"), sampling, max_frames, video_kwargs)  # noqa: E731
            return mm_hash, self._get_or_compute(mm_hash, lambda: self._run_video(load(), video_kwargs, sampling))
        video = self._load_video(video, sampling, max_frames, video_kwargs)
        timing = {"qwen3_vl_timing": self.qwen3_videos.timing(video)} if self.qwen3_videos is not None else {}
        mm_hash = hash_mm_item("video", video, {**video_kwargs, **sampling, "max_frames": max_frames, **timing})
        return mm_hash, self._get_or_compute(mm_hash, lambda: self._run_video(video, video_kwargs, sampling))

    def _load_video(self, video: Any, sampling: dict, max_frames: int, video_kwargs: dict) -> LoadedVideo:
        """Decode and sample; each frame kept no larger than the video processor keeps it (video_frame_size)."""
        if isinstance(video, LoadedVideo):
            return video
        fps, num_frames = sampling.get("fps"), sampling.get("num_frames")
        kw = self._video_hf_kwargs(video_kwargs)
        frame_size = video_frame_size(self.video_processor, kw, self.max_video_frame_pixels)
        return load_video(video, fps, num_frames, max_frames, max_pixels=self.max_image_pixels, frame_size=frame_size)

    def _run_video(self, video: LoadedVideo, video_kwargs: dict, sampling: dict) -> dict:
        import torch

        try:
            if hasattr(self.family, "run_video"):  # a family's own video rules (InternVL: one tile per frame)
                return self.family.run_video(video.frames, video_kwargs)
            out = self.video_processor(
                videos=[video.frames],
                return_tensors="pt",
                do_sample_frames=False,
                input_data_format="channels_last",
                **self._video_hf_kwargs(video_kwargs),
            )
        except Exception as e:  # as for images
            raise ValueError(
                f"video processing failed (mm_processor_kwargs={shorten(video_kwargs)}): {_last_line(e)}"
            ) from None
        fps = video.sampled_fps or sampling.get("fps") or DEFAULT_VIDEO_FPS
        temporal_patch = int(getattr(self.video_processor, "temporal_patch_size", 2))
        timing = self.qwen3_videos.timing(video) if self.qwen3_videos is not None else {}
        return {
            "pixel_values_videos": out["pixel_values_videos"],
            "video_grid_thw": out["video_grid_thw"],
            "second_per_grid_ts": torch.tensor([temporal_patch / float(fps)], dtype=torch.float32),
            **timing,
        }

    def process_audio(self, audio: Any) -> tuple[str, dict]:
        """Decode (mono, the extractor's rate), hash and (on a cache miss) extract one clip's features
        -> (mm_hash, data); data as vlserve.multimodal.audio.AudioItemProcessor describes."""
        if self.audio_processor is None:
            raise ValueError("this model's processor has no audio feature extractor; audio is not supported")
        if isinstance(audio, NamedItem):  # as for images
            load = lambda: self.audio_processor.load_and_hash(audio.require_media("audio"))[0]  # noqa: E731
            mm_hash = hash_named_item("audio", audio.uuid)
            return mm_hash, self._get_or_compute(mm_hash, lambda: self.audio_processor.features(load()))
        clip, mm_hash = self.audio_processor.load_and_hash(audio)
        return mm_hash, self._get_or_compute(mm_hash, lambda: self.audio_processor.features(clip))

    # ----------------------------------------------------------------------------------------------- prompt
    def process(
        self,
        prompt_token_ids: list[int],
        images: list | None = None,
        videos: list | None = None,
        mm_processor_kwargs: dict | None = None,
        audios: list | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Expand each `<|image_pad|>` / `<|video_pad|>` token of the prompt into its item's embedding count and
        return (new_prompt_token_ids, features ordered by offset).

        The i-th image placeholder (in prompt order) belongs to images[i], likewise for videos; a count mismatch
        raises ValueError. mm_processor_kwargs (min_pixels, max_pixels, fps, num_frames, ...) reach the HF
        processors / frame sampling and are folded into each item's mm_hash; `video_pruning_rate` R > 0 leaves a
        video only its retained placeholders (video_pruning.py). A Qwen3-VL video placeholder becomes timestamp
        text plus one pad run (and one feature) per frame pair; an InternVL one `FrameN: <img>...</img>` per frame
        (the family's `expand_video`).
        """
        images, videos, audios = list(images or []), list(videos or []), list(audios or [])
        ids = list(prompt_token_ids)
        img_pos = [i for i, t in enumerate(ids) if t == self.image_token_id]
        vid_pos = [i for i, t in enumerate(ids) if t == self.video_token_id and t is not None]
        if len(img_pos) != len(images):
            raise ValueError(
                f"prompt has {len(img_pos)} image placeholder tokens ({self.placeholders.get('image')}) "
                f"but {len(images)} images were given"
            )
        if len(vid_pos) != len(videos):
            raise ValueError(
                f"prompt has {len(vid_pos)} video placeholder tokens ({self.placeholders.get('video')}) "
                f"but {len(videos)} videos were given"
            )
        aud_pos = [i for i, t in enumerate(ids) if t == self.audio_token_id] if self.audio_token_id is not None else []
        if len(aud_pos) != len(audios):
            raise ValueError(
                f"prompt has {len(aud_pos)} audio placeholder tokens (<|AUDIO|>) "
                f"but {len(audios)} audio clips were given"
            )

        rate, mm_processor_kwargs = pruning.take_pruning_rate(mm_processor_kwargs, bool(videos), self.prunes_videos)
        image_kwargs, video_kwargs, sampling = self._split_kwargs(mm_processor_kwargs)
        items: list[tuple[int, str, str, dict]] = []  # (position in input prompt, modality, mm_hash, data)
        for pos, image in zip(img_pos, images):
            items.append((pos, "image", *self.process_image(image, image_kwargs)))
        for pos, video in zip(vid_pos, videos):
            items.append((pos, "video", *self.process_video(video, video_kwargs, sampling)))
        for pos, audio in zip(aud_pos, audios):
            items.append((pos, "audio", *self.process_audio(audio)))
        items.sort(key=lambda it: it[0])
        if hasattr(self.family, "expand_prompt"):  # Gemma 3: the text next to each image is tokenized anew
            return self.family.expand_prompt(ids, items)

        new_ids: list[int] = []
        features: list[MultiModalFeature] = []
        prev = 0
        for pos, modality, mm_hash, data in items:
            if modality == "video" and self.video_expander is not None:  # per-frame runs, text between them
                prune = {"pruning_rate": rate} if rate else {}  # (only Qwen3-VL's expander is asked to prune)
                start, end, run, frame_features = self.video_expander.expand_video(mm_hash, data, ids, pos, **prune)
                new_ids.extend(ids[prev:start])
                for f in frame_features:  # offsets in `run` -> in the new prompt
                    f.offset += len(new_ids)
                new_ids.extend(run)
                features.extend(frame_features)
                prev = end
                continue
            if modality == "audio":
                num = audio_tokens(int(data["valid_frames"][0]))
            elif self.family is not None:
                num = self.family.num_embeds(modality, data)
            elif modality == "video" and rate:  # pruned: the kept count (video_pruning.py), a key of its own
                mm_hash, data, num = pruning.pruned_video(mm_hash, data, rate, self._merge_size("video"))
            else:
                grid = data["image_grid_thw" if modality == "image" else "video_grid_thw"][0]
                num = int(grid.prod()) // self._merge_size(modality) ** 2
            new_ids.extend(ids[prev:pos])
            # a family may spell the run out: tokens around it (InternVL's <img> ... </img>) or inside it (Pixtral's
            # row breaks, which are then rows of the item's embeddings too); `start`: where the embeddings begin
            spell = getattr(self.family, "placeholder_run", None) if modality == "image" else None
            run, start = spell(ids[pos], num, data) if spell is not None else ([ids[pos]] * num, 0)
            features.append(
                MultiModalFeature(
                    modality=modality, mm_hash=mm_hash, offset=len(new_ids) + start, length=num, data=data
                )
            )
            new_ids.extend(run)
            prev = pos + 1
        new_ids.extend(ids[prev:])
        return new_ids, features

    @property
    def prunes_videos(self) -> bool:
        """Whether its videos can be pruned (video_pruning.py): Qwen2-VL / Qwen2.5-VL grids, Qwen3-VL steps."""
        return self.qwen3_videos is not None or (self.video_expander is None and self.family is None)

    def max_image_embeds(self, mm_processor_kwargs: dict | None = None) -> int:
        """Upper bound on the embeddings of one image (for sizing the encoder cache / budget)."""
        if self.image_processor is None:
            return 0
        kw = mm_processor_kwargs or {}
        if self.family is not None:
            return self.family.max_image_embeds(kw)
        max_pixels = (
            kw.get("max_pixels") or self.image_processor.size.get("longest_edge") or self.image_processor.max_pixels
        )
        unit = int(self.image_processor.patch_size) * self._merge_size("image")
        return int(max_pixels) // (unit * unit)

    def max_video_embeds(self, num_frames: int | None = None, mm_processor_kwargs: dict | None = None) -> int:
        """Upper bound on the embeddings of one video of at most `num_frames` frames (default: max_video_frames)."""
        if self.video_processor is None:
            return 0
        kw = mm_processor_kwargs or {}
        num_frames = num_frames or int(kw.get("max_frames", self.max_video_frames))
        if hasattr(self.family, "max_video_embeds"):
            return self.family.max_video_embeds(num_frames, kw)
        max_pixels = kw.get("max_pixels") or self.video_processor.size["longest_edge"]
        unit = int(self.video_processor.patch_size) * self._merge_size("video")
        temporal = int(self.video_processor.temporal_patch_size)
        return -(-num_frames // temporal) * (int(max_pixels) // (unit * unit))


def _unambiguous(img: Any) -> Any:
    """`img` itself (a PIL image, or its `[H, W, 3]` uint8 array), or as that array when `_layout_kwargs` states
    its layout."""
    import numpy as np

    return np.array(img) if not isinstance(img, np.ndarray) and img.height in (1, 3) else img


def _layout_kwargs(img: Any) -> dict:
    """transformers 4.57's numpy image processors guess the channel axis and take an image 1 or 3 rows high as
    channels-first; for those images, and for `[H, W, 3]` arrays, the array is passed with its layout stated."""
    return {"input_data_format": "channels_last"} if not hasattr(img, "mode") or img.height in (1, 3) else {}
