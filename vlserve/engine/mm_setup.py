"""Multimodal wiring for a loaded checkpoint: the HF processor wrapper and M-RoPE position function."""
from __future__ import annotations

from vlserve.engine.model_setup import LoadedModel


def attach_multimodal(loaded: LoadedModel, modalities: tuple[str, ...]) -> None:
    """Give `loaded` its MultiModalProcessor (the checkpoint's own AutoProcessor) and, for M-RoPE models, the
    function that turns an expanded prompt + its media into 3-axis positions."""
    from vlserve.multimodal.mrope import get_mrope_positions
    from vlserve.multimodal.processor import MultiModalProcessor

    try:
        mm_processor = MultiModalProcessor.from_pretrained(loaded.model_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the HF processor of {loaded.model_path!r} (preprocessor_config.json and "
                         f"friends are needed for {', '.join(modalities)} input): {e}") from e
    loaded.processor = mm_processor.hf_processor
    loaded.mm_processor = mm_processor
    loaded.modalities = modalities
    hf_config = loaded.hf_config
    if getattr(loaded.model, "uses_mrope", False):
        loaded.mrope_positions_fn = lambda ids, feats: get_mrope_positions(ids, feats, hf_config)
