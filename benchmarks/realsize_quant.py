"""`benchmarks.realsize --quantized DIR`: each engine's quantized configuration of the same model. vlserve and
vLLM-CPU run DIR, a compressed-tensors W8A8 copy of the base checkpoint (INT8 weights per channel, INT8 activations
per token; vlserve's towers as --vlserve-kwargs say, e.g. mm_encoder_quantization="int8"); OpenVINO GenAI runs the
base checkpoint exported with int8 weights. Compute stays bf16 where it is not int8."""

from __future__ import annotations

import json
import os

from benchmarks.anchors import openvino_export

QUANTIZED_DTYPE = "bfloat16"
# the model's shapes that the copy must share with the base checkpoint (text and vision config keys)
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
VISION_SHAPE_KEYS = ("depth", "embed_dim", "num_heads", "patch_size")


def check_w8a8_checkpoint(path: str) -> None:
    """ValueError unless `path` is a checkpoint whose config has a compressed-tensors quantization_config with INT8
    weights and INT8 activations in every scheme group."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--quantized {path!r}: no config.json there")
    with open(config_path) as f:
        qconfig = json.load(f).get("quantization_config") or {}
    if qconfig.get("quant_method") != "compressed-tensors":
        raise ValueError(f"--quantized {path!r}: not a compressed-tensors checkpoint (quantization_config: {qconfig})")
    groups = qconfig.get("config_groups") or {}
    for name, group in groups.items():
        weights, activations = group.get("weights") or {}, group.get("input_activations") or {}
        for what, args in (("weights", weights), ("input activations", activations)):
            if (args.get("num_bits"), args.get("type")) != (8, "int"):
                raise ValueError(f"--quantized {path!r}: scheme group {name}'s {what} are not INT8: {args or None}")
    if not groups:
        raise ValueError(f"--quantized {path!r}: its quantization_config has no scheme groups")


def check_same_model(base: str, quantized: str) -> None:
    """ValueError unless `quantized`'s text and vision shapes are `base`'s (the copy is of this run's checkpoint)."""
    from transformers import AutoConfig

    base_config, quantized_config = (AutoConfig.from_pretrained(p) for p in (base, quantized))
    for part, keys in (("text", SHAPE_KEYS), ("vision", VISION_SHAPE_KEYS)):
        want, got = (
            c.get_text_config() if part == "text" else c.vision_config for c in (base_config, quantized_config)
        )
        for key in keys:
            if getattr(got, key) != getattr(want, key):
                raise ValueError(
                    f"--quantized {quantized!r} is not a copy of the checkpoint {base!r}: {part} {key} "
                    f"{getattr(got, key)} != {getattr(want, key)}"
                )


def quantized_labels(vlserve_kwargs: dict) -> dict[str, str]:
    """The table's engine names under --quantized; vlserve's says INT8 towers only when its kwargs ask for them."""
    towers = " + INT8 towers" if vlserve_kwargs.get("mm_encoder_quantization") == "int8" else ""
    return {"vlserve": f"vlserve W8A8{towers}", "vllm": "vLLM-CPU W8A8", "openvino": "OpenVINO int8 weights"}


def engine_checkpoint(
    engine: str, base: str, quantized: str | None, dtype: str, export_dir: str, python: str | None = None
) -> str:
    """The checkpoint `engine` runs: without `quantized`, `base` (OpenVINO: its export for `dtype`); with it,
    `quantized` for vlserve and vLLM, and `base`'s int8-weight export (cached under `export_dir`) for OpenVINO."""
    if engine != "openvino":
        return quantized or base
    return openvino_export(base, dtype, export_dir, python, "int8" if quantized else None)
