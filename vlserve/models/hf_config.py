"""Read Hugging Face configs written by transformers 4.x or 5.x (the one place that knows both layouts).

transformers 4.57 and 5.x differ in where a config keeps some fields: 4.x spells RoPE as `rope_theta` plus
`rope_scaling` (with `type` or `rope_type`), 5.x as one `rope_parameters` dict; a 4.57-saved Qwen2-VL config
can carry `architectures` (and token ids) only inside `text_config`; `tie_word_embeddings` may sit at the top
level, in `text_config`, or both. Everything else in vlserve asks these helpers instead of branching on the
installed version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeParams:
    """Everything needed to compute RoPE inverse frequencies, independent of the config's spelling.

    `scaling` holds the type-specific keys (factor, original_max_position_embeddings, low/high_freq_factor,
    beta_fast/beta_slow, attention_factor, mscale, mscale_all_dim, truncate) as the config gave them.
    """

    rope_type: str
    theta: float
    head_dim: int
    max_position_embeddings: int
    partial_rotary_factor: float = 1.0
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL's t, h, w, t, h, w, ... frequency layout
    scaling: dict[str, Any] = field(default_factory=dict)


def text_config_of(hf_config):
    """The language-model part of a config (`text_config` of a multimodal config, else the config itself)."""
    sub = getattr(hf_config, "text_config", None)
    return sub if sub is not None else hf_config


def architectures_of(hf_config) -> tuple[list[str], str]:
    """`(architectures, where)`: the top-level list, else the one a 4.57-saved multimodal config nests in
    `text_config` (`where` names the place it was read from); ValueError when neither has one."""
    top = getattr(hf_config, "architectures", None)
    if top:
        return list(top), "architectures"
    sub = getattr(hf_config, "text_config", None)
    nested = getattr(sub, "architectures", None) if sub is not None else None
    if nested:
        return list(nested), "text_config.architectures"
    place = "at the top level of config.json" + (" nor in its text_config" if sub is not None else "")
    raise ValueError(f"model config has no 'architectures' entry {place}")


def tie_word_embeddings_of(hf_config) -> bool:
    """Whether lm_head shares the embedding matrix: the text config's own flag when it sets one, else the top
    level's (False when neither does)."""
    for cfg in (text_config_of(hf_config), hf_config):
        value = getattr(cfg, "tie_word_embeddings", None)
        if value is not None:
            return bool(value)
    return False


def token_id_of(hf_config, name: str) -> int | None:
    """A special token id field (`image_token_id`, `eos_token_id`, ...) from the top level or `text_config`."""
    for cfg in (hf_config, text_config_of(hf_config)):
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def _rope_dict(config) -> dict[str, Any]:
    """The config's RoPE dict, either spelling (5.x `rope_parameters`, 4.x `rope_scaling`), copied."""
    for key in ("rope_parameters", "rope_scaling"):
        value = getattr(config, key, None)
        if isinstance(value, dict) and value:
            if any(isinstance(v, dict) for v in value.values()):
                raise ValueError(f"per-layer-type RoPE parameters ({key} keyed by {sorted(value)}) are not supported")
            return dict(value)
    return {}


def rope_params_of(text_config) -> RopeParams:
    """The text config's RoPE settings, read from either spelling.

    The type comes from `rope_type` (or the older `type`); "mrope" (Qwen2-VL's pre-4.45 spelling) means
    "default" with an M-RoPE section. A `rope_theta` attribute (4.x, or an override set on a copy) wins over
    the one inside the dict (5.x).
    """
    return _rope_params(text_config, _rope_dict(text_config), getattr(text_config, "rope_theta", None))


def layer_type_rope_params_of(text_config, layer_type: str) -> RopeParams:
    """The RoPE settings of the layers of `layer_type` ("full_attention" | "sliding_attention"), e.g. Gemma 3's:
    5.x keys `rope_parameters` by layer type (each entry has its own `rope_theta`); 4.x gives the full layers
    `rope_theta` + `rope_scaling` and the sliding ones default RoPE at `rope_local_base_freq`. A config with one
    RoPE for all layers gives it to every type."""
    for key in ("rope_parameters", "rope_scaling"):
        per_type = getattr(text_config, key, None)
        if isinstance(per_type, dict) and any(isinstance(v, dict) for v in per_type.values()):
            if not isinstance(per_type.get(layer_type), dict):
                raise ValueError(
                    f"{key} has no RoPE parameters for layer type {layer_type!r} (it has {sorted(per_type)})"
                )
            return _rope_params(text_config, dict(per_type[layer_type]), None)
    local_theta = getattr(text_config, "rope_local_base_freq", None)
    if layer_type == "sliding_attention" and local_theta is not None:
        return _rope_params(text_config, {}, local_theta)
    return rope_params_of(text_config)


def _rope_params(text_config, d: dict[str, Any], theta: float | None) -> RopeParams:
    """RopeParams from a (copied) flat RoPE dict `d`; `theta`, when not None, wins over `d`'s `rope_theta`."""
    rope_type = d.pop("rope_type", None) or d.pop("type", None) or "default"
    d.pop("type", None)
    if rope_type == "mrope":
        rope_type = "default"
    dict_theta = d.pop("rope_theta", None)
    theta = theta if theta is not None else dict_theta if dict_theta is not None else DEFAULT_ROPE_THETA
    section = d.pop("mrope_section", None)
    interleaved = bool(d.pop("mrope_interleaved", False))
    partial = d.pop("partial_rotary_factor", None)
    if partial is None:
        partial = getattr(text_config, "partial_rotary_factor", None)
    head_dim = getattr(text_config, "head_dim", None) or (text_config.hidden_size // text_config.num_attention_heads)
    return RopeParams(
        rope_type=str(rope_type),
        theta=float(theta),
        head_dim=int(head_dim),
        max_position_embeddings=int(text_config.max_position_embeddings),
        partial_rotary_factor=float(partial if partial is not None else 1.0),
        mrope_section=tuple(int(s) for s in section) if section is not None else None,
        mrope_interleaved=interleaved,
        scaling=d,
    )


def sliding_window_of(text_config, layer_idx: int) -> int | None:
    """The sliding window W of decoder layer `layer_idx` (its query at p sees keys p - W + 1 .. p), None for full
    attention, as HF's models decide it: no window when `sliding_window` is unset or `use_sliding_window` is False
    (Qwen2/Qwen3); Mistral slides every layer (its model ignores `layer_types`); otherwise a layer slides when
    `layer_types[i] == "sliding_attention"`, or, without layer_types, when i >= `max_window_layers` (Qwen2/Qwen3's
    older configs; a config without that field slides every layer)."""
    window = getattr(text_config, "sliding_window", None)
    if not window or getattr(text_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types and getattr(text_config, "model_type", None) != "mistral":
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    max_window_layers = getattr(text_config, "max_window_layers", None)
    if max_window_layers is not None and getattr(text_config, "model_type", None) != "mistral":
        return int(window) if layer_idx >= max_window_layers else None
    return int(window)


def layer_windows_of(text_config) -> list[int | None]:
    """Every decoder layer's sliding window (`sliding_window_of`), in layer order: what the KV cache groups of
    core/kv_cache_groups.py are made from."""
    return [sliding_window_of(text_config, i) for i in range(text_config.num_hidden_layers)]
