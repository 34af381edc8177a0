"""Per-request media controls of the chat and completion endpoints: `media_io_kwargs` (vLLM's field: how media are
loaded, by modality), `image_embeds` content parts (behind `--enable-mm-embeds`) and name-only (`uuid`) parts.

`media_io_kwargs` = {"video": {"num_frames": N} | {"fps": F}}: the frames sampled from each video of the request.
The server's `--media-io-kwargs` are the defaults; a request's value replaces a default key, and (as in vLLM) a
request that sets one of num_frames / fps drops the other's default. num_frames is bounded by the processor's frame
cap, fps by `MediaConfig.max_video_fps`; a value over a bound is a 400 naming it. The result reaches the processor
as its frame-sampling kwargs (`fps`, `num_frames`), which key the processor and encoder caches like every kwarg.
Completion requests carry no media: their `media_io_kwargs` are checked the same way and change nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlserve.api.errors import APIError
from vlserve.api.media import MediaConfig
from vlserve.api.serving_base import MMKwargLimits
from vlserve.multimodal.media_refs import decode_image_embeds
from vlserve.shorten import shorten

_FIELD = "media_io_kwargs"
_VIDEO_KEYS = ("num_frames", "fps")  # the counterpart of each is dropped from the defaults when one is sent


@dataclass
class MediaIOControls:
    """The server's media_io_kwargs defaults and bounds, and the per-request merge."""

    defaults: dict[str, dict[str, Any]]
    max_frames: int | None = None
    max_fps: float | None = None
    enable_mm_embeds: bool = False
    max_embeds_bytes: int = 64 << 20

    @classmethod
    def from_engine(cls, engine: Any, media: MediaConfig | None = None) -> MediaIOControls:
        """Bounds from the engine's processor (frame cap) and `media`; the defaults checked against them
        (ValueError naming --media-io-kwargs)."""
        media = media or MediaConfig()
        limits = MMKwargLimits.from_engine(engine)
        controls = cls({}, limits.max_frames, media.max_video_fps, media.enable_mm_embeds, media.max_bytes["image"])
        try:
            controls.defaults = controls.check(media.media_io_kwargs)
        except APIError as e:
            raise ValueError(f"--media-io-kwargs: {e.message}") from None
        return controls

    def check(self, value: Any) -> dict[str, dict[str, Any]]:
        """A media_io_kwargs value -> {modality: kwargs}, checked (APIError 400 naming the key otherwise)."""
        if not value:
            return {}
        if not isinstance(value, dict):
            raise APIError(
                f"{_FIELD} must be an object keyed by modality, e.g. " + '{"video": {"num_frames": 8}}', 400, _FIELD
            )
        out: dict[str, dict[str, Any]] = {}
        for modality, kwargs in value.items():
            if modality not in ("image", "video", "audio"):
                raise APIError(f"{_FIELD}: unknown modality {shorten(modality)}; use video", 400, _FIELD)
            if not isinstance(kwargs, dict):
                raise APIError(f"{_FIELD}.{modality} must be an object", 400, _FIELD)
            allowed = _VIDEO_KEYS if modality == "video" else ()
            unknown = [k for k in kwargs if k not in allowed]
            if unknown:
                keys = ", ".join(allowed) or "none"
                raise APIError(
                    f"{_FIELD}.{modality}: unsupported key(s) {shorten(unknown)}; supported: {keys}", 400, _FIELD
                )
            for key, v in kwargs.items():
                self._check_value(f"{_FIELD}.{modality}.{key}", key, v)
            if "num_frames" in kwargs and "fps" in kwargs:
                raise APIError(f"{_FIELD}.video: send num_frames or fps, not both", 400, _FIELD)
            out[modality] = dict(kwargs)
        return out

    def _check_value(self, name: str, key: str, value: Any) -> None:
        whole = key == "num_frames"
        if isinstance(value, bool) or not isinstance(value, (int,) if whole else (int, float)) or value <= 0:
            raise APIError(
                f"{name} must be a positive {'integer' if whole else 'number'}, got {shorten(value)}", 400, _FIELD
            )
        bound = self.max_frames if whole else self.max_fps
        if bound is not None and value > bound:
            raise APIError(f"{name} may be at most {bound:g} on this server, got {value:g}", 400, _FIELD)

    def merge(self, request_value: Any, mm_kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        """The request's (checked) mm_processor_kwargs with its video sampling from media_io_kwargs (the request's
        over the server's defaults). The same sampling key sent in both fields is a 400; mm_processor_kwargs' own
        fps / num_frames replace the media_io_kwargs defaults."""
        requested = self.check(request_value).get("video", {})
        mm_kwargs = dict(mm_kwargs or {})
        own = [k for k in _VIDEO_KEYS if k in mm_kwargs]
        if own and requested:
            raise APIError(
                f"video frame sampling is set in both mm_processor_kwargs ({', '.join(own)}) and {_FIELD}; "
                f"send it in one",
                400,
                _FIELD,
            )
        if own:
            return mm_kwargs
        video = dict(self.defaults.get("video", {}))
        for key, other in (("num_frames", "fps"), ("fps", "num_frames")):
            if key in requested and other not in requested:
                video.pop(other, None)
        video.update(requested)
        if not video:
            return mm_kwargs or None
        # the server's --mm-processor-kwargs may set the counterpart: None keeps it from applying to this request
        return {**mm_kwargs, "num_frames": video.get("num_frames"), "fps": video.get("fps")}

    def check_parts(self, messages: list[dict]) -> None:
        """Fail fast on image_embeds parts this server does not take."""
        if self.enable_mm_embeds:
            return
        for msg in messages:
            content = msg.get("content") if isinstance(msg, dict) else None
            for part in content if isinstance(content, list) else ():
                if isinstance(part, dict) and part.get("type") == "image_embeds":
                    raise APIError(
                        "image_embeds content parts need a server started with --enable-mm-embeds", 400, "messages"
                    )

    def media_source(self, payloads: dict[int, Any]) -> Callable[[str, dict], Any]:
        """The chat parser's media source: fetched payloads by part, image_embeds decoded (in the caller's
        thread: the input-processing pool)."""

        def source(part_type: str, part: dict) -> Any:
            if part_type == "image_embeds":
                return decode_image_embeds(part.get("image_embeds"), self.max_embeds_bytes)
            return payloads[id(part)]

        return source
