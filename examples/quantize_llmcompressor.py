"""Quantize a local checkpoint with llm-compressor (round-to-nearest, no calibration data) into the
compressed-tensors format vlserve loads. Run it with a python that has llmcompressor (it pins its own torch and
transformers, so give it a venv of its own):

    make quant-tools        # .venv-quant: llm-compressor with the torch / transformers it pins
    .venv-quant/bin/python examples/quantize_llmcompressor.py MODEL_DIR OUT_DIR --scheme W4A16
    .venv/bin/vlserve serve OUT_DIR

Schemes (llm-compressor's presets): W4A16, W4A16_ASYM, W8A16 (weight-only, group 128), W8A8 (INT8 weights per
channel, INT8 activations per token), FP8_DYNAMIC, FP8_BLOCK. The LM head and, for vision-language models, the
vision tower and projector stay unquantized (the usual VLM recipe; vlserve runs only the language model quantized).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

# vision towers / projectors / audio towers of the families vlserve serves, by their transformers module names
KEEP_FLOAT = [
    "lm_head",
    "re:.*visual.*",
    "re:.*vision_tower.*",
    "re:.*multi_modal_projector.*",
    "re:.*audio_tower.*",
    "re:.*vision_model.*",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="local HF checkpoint directory")
    p.add_argument("out", help="where to write the quantized checkpoint")
    p.add_argument(
        "--scheme", default="W4A16", choices=["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8_DYNAMIC", "FP8_BLOCK"]
    )
    args = p.parse_args()

    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

    config = AutoConfig.from_pretrained(args.model)
    is_vlm = hasattr(config, "vision_config") or hasattr(config, "audio_config")
    loader = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
    model = loader.from_pretrained(args.model, dtype="auto")
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=args.scheme, ignore=KEEP_FLOAT))
    model.save_pretrained(args.out, save_compressed=True)
    try:
        AutoProcessor.from_pretrained(args.model).save_pretrained(args.out)
    except (OSError, ValueError, TypeError):
        pass  # a text model: its tokenizer files are copied below
    for f in Path(args.model).iterdir():  # tokenizer, chat template, generation config, preprocessor configs
        if (
            f.is_file()
            and not f.name.endswith((".safetensors", ".json.index"))
            and f.name != "config.json"
            and not (Path(args.out) / f.name).exists()
        ):
            shutil.copy(f, args.out)
    print(f"wrote {args.out} ({args.scheme})")


if __name__ == "__main__":
    main()
