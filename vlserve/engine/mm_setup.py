"""Multimodal parts of a checkpoint: the HF processor wrapper and the M-RoPE position function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlserve.executor.worker import mrope_positions_fn_for
from vlserve.models.capabilities import capabilities_of, model_capabilities
from vlserve.models.registry import get_model_class
from vlserve.multimodal.dual_tower_items import DualTowerProcessor
from vlserve.multimodal.processor import MultiModalProcessor


@dataclass(frozen=True)
class MultimodalParts:
    """What a multimodal checkpoint adds to `LoadedModel` (all None / () for a text-only model)."""

    modalities: tuple[str, ...] = ()
    processor: Any = None  # the HF AutoProcessor
    mm_processor: MultiModalProcessor | None = None
    mrope_positions_fn: Callable | None = None


def load_multimodal(
    model_path: str,
    hf_config: Any,
    model: Any,
    max_audio_seconds: float | None = None,
    use_fast: bool = True,
    processor: bool = True,
    video_limits: dict[str, int] | None = None,
) -> MultimodalParts:
    """The checkpoint's own AutoProcessor (wrapped; `use_fast`: its torchvision-backed image processor where one
    exists; none without `processor`) and, for M-RoPE models, the function that turns an expanded prompt + its
    media into 3-axis positions; empty parts when the model takes no media. Audio clips longer than
    `max_audio_seconds` are refused; `video_limits` (`video_limits_from_args`) bound the frames kept per video."""
    caps = capabilities_of(model)
    modalities = caps.modalities
    if not modalities:
        return MultimodalParts()
    if not processor:
        return MultimodalParts(modalities, mrope_positions_fn=mrope_positions_fn_for(model, hf_config))
    try:
        kwargs = {"max_audio_seconds": max_audio_seconds} if "audio" in modalities else {}
        kwargs.update((video_limits or {}) if "video" in modalities else {})
        mm_processor = (
            dual_tower_processor(model_path, hf_config, use_fast)
            if caps.dual_tower
            else MultiModalProcessor.from_pretrained(
                model_path, use_fast=use_fast, image_token_id=caps.image_token_id, **kwargs
            )
        )
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load the HF processor of {model_path!r} (preprocessor_config.json and "
            f"friends are needed for {', '.join(modalities)} input): {e}"
        ) from e
    return MultimodalParts(
        modalities, mm_processor.hf_processor, mm_processor, mrope_positions_fn_for(model, hf_config)
    )


def video_limits_from_args(args: Any) -> dict[str, int]:
    """The MultiModalProcessor's video bounds an EngineArgs sets (frames kept per video, pixels per decoded frame);
    those left None keep the processor's defaults."""
    names = ("max_video_frames", "max_video_frame_pixels")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def dual_tower_processor(model_path: str, hf_config: Any, use_fast: bool = True) -> DualTowerProcessor | None:
    """A dual-tower embedder's request processor (one text or one image per request), None for other models."""
    model_cls = get_model_class(hf_config)
    if not model_capabilities(model_cls, hf_config).dual_tower:
        return None
    return DualTowerProcessor.from_pretrained(
        model_path,
        use_fast=use_fast,
        text_padding_length=model_cls.text_padding_length(hf_config),
        check_text_ids=lambda ids: model_cls.check_text_ids(hf_config, ids),
    )
