#!/usr/bin/env python
"""Make the quantized test checkpoints in tests/fixtures/quant/ with the REAL quantization tools.

    make quant-fixtures                                   # creates .venv-quant / .venv-gptq when missing, then:
    .venv-quant/bin/python -m tools.make_quant_fixtures   # everything (GPTQ/AWQ through .venv-gptq/bin/python)
    .venv-quant/bin/python -m tools.make_quant_fixtures --only ct_w4a16 ct_vl_w4a16
    .venv/bin/python -m tools.make_quant_fixtures --verify  # re-run the oracles in another venv, compare

Two tool venvs, because their pins exclude each other:
  .venv-quant  llmcompressor 0.14.0.1 (torch <= 2.14.0, transformers <= 5.17, compressed-tensors 0.19.0)
  .venv-gptq   gptqmodel 7.7.0 (torch >= 2.14.1, transformers >= 5.20.2)
Both have vlserve installed with `pip install -e . --no-deps` (its test-checkpoint builders make the base models).

The base checkpoints come from vlserve's own builders (bfloat16, like released checkpoints): a Qwen2 causal LM
(hidden 128, intermediate 256, 2 layers, so group size 128 divides every linear's input) and a Qwen2-VL with the
same language model. The tools venv builds them once and hands the text one to the GPTQ stage.

Every fixture directory gets `reference.json`: for 3 text prompts (and one image prompt for the VL fixtures) the
greedy continuation of 16 tokens in float32 (a full-recompute argmax loop over the whole vocabulary, so EOS never
stops it), with each step's top-1 logit, the log-softmax of the chosen token and the top-1/top-2 margin, computed by
the format's own library:
  compressed-tensors: transformers `from_pretrained(dir, dtype=float32)`, which decompresses through
    compressed-tensors. Schemes with input-activation quantization (W8A8, FP8) get two result sets: `transformers`
    (the default load, which fake-quantizes each targeted Linear's input on the fly) and
    `transformers_weights_only` (the same model with `quantization_enabled = False` on every module).
  GPTQ / AWQ: `<name>/dequantized/` is a plain float32 HF checkpoint whose linears were dequantized by GPTQModel's
    own functions (GPTQ: gptqmodel.utils.model_dequant.dequantize_model; AWQ:
    gptqmodel.quantization.awq.utils.packing_utils.dequantize_gemm, the AWQ torch kernel's dequantizer), and the
    primary result set `transformers_dequantized_fp32` is transformers run on it; `gptqmodel_kernel` is
    GPTQModel.load(dir, backend=TORCH / AWQ_TORCH) itself (GPTQ in float32; AWQ's torch kernel computes in float16).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "quant"
DEFAULT_GPTQ_PYTHON = REPO / ".venv-gptq" / "bin" / "python"
MAX_NEW_TOKENS = 16

TEXT_BASE = dict(
    arch="qwen2",
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=256,
    tie_word_embeddings=False,
    seed=0,
)
# head_dim = 128 / 4 = 32, so the M-RoPE sections must add up to 16
VL_BASE = dict(
    variant="qwen2_vl",
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    mrope_section=(4, 6, 6),
    seed=0,
)

# name -> (base model, llm-compressor preset scheme)
CT_FIXTURES = {
    "ct_w8a8_int8": ("text", "W8A8"),
    "ct_fp8_dynamic": ("text", "FP8_DYNAMIC"),
    "ct_fp8_block": ("text", "FP8_BLOCK"),
    "ct_w4a16": ("text", "W4A16"),
    "ct_w4a16_asym": ("text", "W4A16_ASYM"),
    "ct_w8a16": ("text", "W8A16"),
    "ct_vl_w4a16": ("vl", "W4A16"),
    "ct_vl_w8a8_int8": ("vl", "W8A8"),
}
# the module names the models really have (transformers 5.x): Qwen2-VL's vision tower is `model.visual.*`
CT_IGNORE = {"text": ["lm_head"], "vl": ["lm_head", "re:.*visual.*"]}

GPTQ_FIXTURES = {
    "gptq_4bit_g128": dict(method="gptq", bits=4, group_size=128, desc_act=False),
    "gptq_4bit_g128_actorder": dict(method="gptq", bits=4, group_size=128, desc_act=True),
    "gptq_8bit_g128": dict(method="gptq", bits=8, group_size=128, desc_act=False),
    # zero_point=True (sym=False): the usual AutoAWQ GEMM layout
    "awq_4bit_g128": dict(method="awq", bits=4, group_size=128, sym=False),
}

TEXT_PROMPTS = [
    ("plain", "The quick brown fox jumps over the lazy dog"),
    ("question", "Hello world, what color is the small square?"),
    ("chat", [{"role": "user", "content": "Describe the picture in one sentence, please."}]),
]
VL_IMAGE_PROMPT = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape is in the image?"}]}
]
IMAGE_SPEC = dict(size=[112, 112], background=[30, 60, 200], square=[28, 28, 84, 84], square_color=[220, 40, 40])


# ----------------------------------------------------------------------------------------------------------- helpers


def log(msg: str) -> None:
    print(f"[quant-fixtures] {msg}", flush=True)


def make_image():
    """112x112 RGB: a red square (x/y 28..83) on a blue background; saved next to the VL fixtures as image.png."""
    from PIL import Image

    img = Image.new("RGB", tuple(IMAGE_SPEC["size"]), tuple(IMAGE_SPEC["background"]))
    img.paste(tuple(IMAGE_SPEC["square_color"]), tuple(IMAGE_SPEC["square"]))
    return img


def calibration_texts(n: int = 16) -> list[str]:
    """Deterministic short plain-text samples from the test tokenizer's word list (no downloads)."""
    from vlserve.demo.tokenizer import _WORDS

    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(24, 48))).capitalize() + "." for _ in range(n)]


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def build_bases(work: Path) -> dict[str, Path]:
    import torch

    from vlserve.demo.checkpoints import build_text_checkpoint
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    text = work / "text_base"
    if not (text / "model.safetensors").exists():
        build_text_checkpoint(str(text), dtype=torch.bfloat16, **TEXT_BASE)
    vl = work / "vl_base"
    if not (vl / "model.safetensors").exists():
        build_qwen2_vl_checkpoint(str(vl), **VL_BASE)  # saved in float32: cast to bfloat16 when quantizing
    return {"text": text, "vl": vl}


def build_prompts(model_dir: Path, kind: str) -> list[dict]:
    """The prompts as token id lists made by the fixture's own tokenizer (and processor for the image)."""
    from transformers import AutoProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for name, content in TEXT_PROMPTS:
        if isinstance(content, str):
            text, ids = content, tok(content)["input_ids"]
        else:
            text = tok.apply_chat_template(content, add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        prompts.append({"name": name, "text": text, "prompt_token_ids": list(map(int, ids)), "image": None})
    if kind == "vl":
        proc = AutoProcessor.from_pretrained(model_dir)
        text = proc.apply_chat_template(VL_IMAGE_PROMPT, add_generation_prompt=True, tokenize=False)
        enc = proc(text=[text], images=[make_image()], return_tensors="pt")
        prompts.append(
            {
                "name": "image",
                "text": text,
                "prompt_token_ids": enc["input_ids"][0].tolist(),
                "image": dict(
                    IMAGE_SPEC,
                    file="image.png",
                    image_grid_thw=enc["image_grid_thw"].tolist(),
                    pixel_values_shape=list(enc["pixel_values"].shape),
                    pixel_values_sum=float(enc["pixel_values"].double().sum()),
                ),
            }
        )
    return prompts


def image_inputs(model_dir: Path, prompt: dict) -> dict:
    """pixel_values / image_grid_thw of an image prompt, re-made by the fixture's processor."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model_dir)
    enc = proc(text=[prompt["text"]], images=[make_image()], return_tensors="pt")
    if enc["input_ids"][0].tolist() != prompt["prompt_token_ids"]:
        raise AssertionError("processor output changed: image prompt ids differ")
    # transformers 5.17+ also wants the processor's mm_token_type_ids (1 on image tokens) for M-RoPE
    return {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}


def step_inputs(extra: dict, length: int, dtype) -> dict:
    """extra image inputs for a sequence of `length` tokens (mm_token_type_ids padded with 0 = text)."""
    import torch

    out = dict(extra)
    if "pixel_values" in out:
        out["pixel_values"] = out["pixel_values"].to(dtype)
    if "mm_token_type_ids" in out:
        t = out["mm_token_type_ids"]
        out["mm_token_type_ids"] = torch.cat([t, t.new_zeros(t.shape[0], length - t.shape[1])], dim=1)
    return out


def greedy(model, model_dir: Path, prompt: dict, steps: int = MAX_NEW_TOKENS) -> dict:
    """Full-recompute greedy decoding (no KV cache, no EOS stop): argmax over the whole vocabulary each step."""
    import torch

    extra = image_inputs(model_dir, prompt) if prompt["image"] else {}
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    ids = torch.tensor([prompt["prompt_token_ids"]])
    res = {"output_token_ids": [], "top1_logits": [], "logprobs": [], "top2_margins": []}
    with torch.no_grad():
        for _ in range(steps):
            inner = getattr(model, "model", None)
            if inner is not None and hasattr(inner, "rope_deltas"):
                inner.rope_deltas = None  # Qwen2-VL caches M-RoPE deltas between calls
            logits = (
                model(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    use_cache=False,
                    **step_inputs(extra, ids.shape[1], dtype),
                )
                .logits[0, -1]
                .float()
            )
            top = torch.topk(logits, 2)
            tok = int(top.indices[0])
            res["output_token_ids"].append(tok)
            res["top1_logits"].append(float(top.values[0]))
            res["logprobs"].append(float(torch.log_softmax(logits, -1)[tok]))
            res["top2_margins"].append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return res


def hf_generate_agrees(model, model_dir: Path, prompts: list[dict], results: list[dict]) -> bool:
    """Cross-check of the loop above with transformers' own generate (tests.support.hf_generate)."""
    import torch

    from tests.support.hf_generate import hf_greedy_ignoring_eos

    for prompt, res in zip(prompts, results):
        inputs = {"input_ids": torch.tensor([prompt["prompt_token_ids"]])}
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if prompt["image"]:
            inputs.update(image_inputs(model_dir, prompt))
        out = hf_greedy_ignoring_eos(model, inputs, MAX_NEW_TOKENS)[0, len(prompt["prompt_token_ids"]) :].tolist()
        if out != res["output_token_ids"]:
            return False
    return True


def compare(a: list[dict], b: list[dict]) -> dict:
    """How closely two result sets agree: tokens equal per prompt, and logit gaps while the tokens agree."""
    same, diff = [], 0.0
    for x, y in zip(a, b):
        same.append(x["output_token_ids"] == y["output_token_ids"])
        for i, (tx, ty) in enumerate(zip(x["output_token_ids"], y["output_token_ids"])):
            diff = max(diff, abs(x["top1_logits"][i] - y["top1_logits"][i]))
            if tx != ty:
                break
    return {"tokens_equal_per_prompt": same, "max_abs_top1_logit_diff_until_first_mismatch": diff}


def first_step_vs_base(model, base_model, model_dir: Path, prompts: list[dict]) -> dict:
    """Sanity check of the quantized model against the unquantized base (a wrong unpacking shows up here)."""
    import torch

    cos, mx = 1.0, 0.0
    with torch.no_grad():
        for p in prompts:
            extra = image_inputs(model_dir, p) if p["image"] else {}
            ids = torch.tensor([p["prompt_token_ids"]])
            outs = []
            for m in (model, base_model):
                inner = getattr(m, "model", None)
                if inner is not None and hasattr(inner, "rope_deltas"):
                    inner.rope_deltas = None
                dtype = next(q.dtype for q in m.parameters() if q.is_floating_point())
                kw = step_inputs(extra, ids.shape[1], dtype)
                outs.append(m(input_ids=ids, use_cache=False, **kw).logits[0].float())
            cos = min(cos, float(torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=-1).min()))
            mx = max(mx, float((outs[0] - outs[1]).abs().max()))
    return {"min_cosine_logits_vs_unquantized_base": round(cos, 6), "max_abs_logit_diff_vs_unquantized_base": mx}


def write_reference(out_dir: Path, ref: dict) -> None:
    with open(out_dir / "reference.json", "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")


def versions(*names: str) -> dict:
    from importlib.metadata import version

    return {n: version(n) for n in names}


# -------------------------------------------------------------------------------------------- compressed-tensors


def load_ct(model_dir: Path, kind: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if kind == "vl" else AutoModelForCausalLM
    # dtype=float32 does not reach Qwen2-VL's sub-models (their text/vision configs say bfloat16): cast afterwards
    # (floating tensors only; the packed integer weights stay as they are and decompress on the first forward;
    # (transformers refuses `.float()` on a quantized model, hence the plain nn.Module method)
    model, info = cls.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    bad = {k: sorted(v)[:4] for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
    if bad:
        raise AssertionError(f"{model_dir}: {bad}")
    return torch.nn.Module.float(model).eval()


# transformers 5.x saves Qwen2-VL in the original checkpoint key layout (`visual.*`, `model.layers.*`) and
# llm-compressor writes the expanded `ignore` list in those names too, while compressed-tensors matches `ignore`
# against the loaded model's module names (`model.visual.*`, `model.language_model.*`), which then tries to
# decompress the vision tower. These are the checkpoint -> module renamings of transformers' conversion_mapping.py
# ("Qwen2VLForConditionalGeneration").
_QWEN2_VL_RENAMES = [(r"^visual", "model.visual"), (r"^model(?!\.(language_model|visual))", "model.language_model")]


def ct_oracle_dir(model_dir: Path, kind: str, tmp: Path) -> Path:
    """The directory transformers loads for the oracle: the fixture itself, or for the VL fixtures a copy
    (symlinks) whose quantization_config.ignore names are renamed to the loaded model's module names."""
    import re

    if kind != "vl":
        return model_dir
    dst = tmp / model_dir.name
    dst.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((model_dir / "config.json").read_text())
    ignore = []
    for name in cfg["quantization_config"]["ignore"]:
        if not name.startswith("re:"):
            for pat, rep in _QWEN2_VL_RENAMES:
                name = re.sub(pat, rep, name)
        ignore.append(name)
    cfg["quantization_config"]["ignore"] = ignore
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def try_load_as_saved(model_dir: Path, kind: str, prompts: list[dict]) -> str:
    """Whether transformers loads the fixture exactly as saved, with no missing / unexpected keys and finite
    first-step logits on every prompt: 'ok' or what went wrong."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if kind == "vl" else AutoModelForCausalLM
    try:
        model, info = cls.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
        model = torch.nn.Module.float(model).eval()
        bad = {k: sorted(v)[:4] for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
        if bad:
            return f"loads, but with {json.dumps(bad)} (first 4 of each)"
        with torch.no_grad():
            for p in prompts:
                extra = image_inputs(model_dir, p) if p["image"] else {}
                ids = torch.tensor([p["prompt_token_ids"]])
                logits = model(input_ids=ids, use_cache=False, **step_inputs(extra, ids.shape[1], torch.float32)).logits
                if not torch.isfinite(logits).all():
                    return f"loads, but the logits of prompt {p['name']!r} are not finite"
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def make_ct(name: str, bases: dict[str, Path], out_root: Path) -> None:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    kind, scheme = CT_FIXTURES[name]
    base = bases[kind]
    out = out_root / name
    shutil.rmtree(out, ignore_errors=True)
    log(f"{name}: llm-compressor oneshot QuantizationModifier(scheme={scheme}, ignore={CT_IGNORE[kind]})")
    cls = AutoModelForImageTextToText if kind == "vl" else AutoModelForCausalLM
    model = cls.from_pretrained(base, dtype=torch.bfloat16)
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=CT_IGNORE[kind])
    oneshot(model=model, recipe=recipe)  # every scheme here is data-free (weights: min/max; activations: dynamic)
    model.save_pretrained(out, save_compressed=True)
    if kind == "vl":
        AutoProcessor.from_pretrained(base).save_pretrained(out)
        make_image().save(out / "image.png")
    else:
        AutoTokenizer.from_pretrained(base).save_pretrained(out)
    del model

    prompts = build_prompts(out, kind)
    checks = {"transformers_loads_as_saved": try_load_as_saved(out, kind, prompts)}
    with tempfile.TemporaryDirectory() as tmp:
        load_dir = ct_oracle_dir(out, kind, Path(tmp))
        if load_dir != out:
            checks["oracle_loaded_from"] = (
                "a copy with quantization_config.ignore renamed to module names (model.visual.*)"
            )
        qmodel = load_ct(load_dir, kind)
        results = {"transformers": [greedy(qmodel, out, p) for p in prompts]}
        cfg = json.loads((out / "config.json").read_text())["quantization_config"]
        has_act = any(g.get("input_activations") for g in cfg["config_groups"].values())
        checks["hf_generate_agrees_with_loop"] = hf_generate_agrees(qmodel, out, prompts, results["transformers"])
        if has_act:
            for m in qmodel.modules():
                m.quantization_enabled = False  # compressed_tensors' quantized forward: skip the activation QDQ
            results["transformers_weights_only"] = [greedy(qmodel, out, p) for p in prompts]
            checks["weights_only_vs_transformers"] = compare(
                results["transformers"], results["transformers_weights_only"]
            )
            qmodel = load_ct(load_dir, kind)
        base_model = cls.from_pretrained(base, dtype=torch.float32).eval()
        checks.update(first_step_vs_base(qmodel, base_model, out, prompts))
    ref = {
        "fixture": name,
        "format": "compressed-tensors",
        "scheme": scheme,
        "base": kind,
        "made_by": {
            "tool": "llmcompressor.oneshot + QuantizationModifier",
            "ignore": CT_IGNORE[kind],
            **versions("llmcompressor", "compressed-tensors", "transformers", "torch"),
        },
        "oracle": (
            "transformers AutoModel*.from_pretrained(dir, dtype=float32) (decompressed by compressed-tensors); "
            "full-recompute greedy loop, no EOS stop"
        ),
        "dtype": "float32",
        "max_new_tokens": MAX_NEW_TOKENS,
        "primary": "transformers",
        "activation_quantization": (
            "default load fake-quantizes each targeted Linear's input (dynamic, see quantization_config); "
            "transformers_weights_only sets quantization_enabled=False on every module"
            if has_act
            else None
        ),
        "prompts": prompts,
        "results": results,
        "checks": checks,
    }
    write_reference(out, ref)
    log(f"{name}: {dir_size(out) / 1024:.0f} KiB, checks {json.dumps(checks)}")


# ------------------------------------------------------------------------------------------------------ GPTQ / AWQ


def gptq_stage(text_base: Path, out_root: Path, names: list[str]) -> None:
    """Runs inside .venv-gptq (gptqmodel 7.7.0)."""
    # GPTQModel sizes its CPU pool as (cores + 1) // 2 but asks for a 2-worker model-loader sub-pool: on a 2-core
    # machine the pool gets 1 worker and GPTQModel.load fails ("requests 2 workers but parent 'cpu' only has 1").
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, ((os.cpu_count() or 1) + 1) // 2)))
    import torch
    from gptqmodel import BACKEND, AWQConfig, GPTQConfig, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from gptqmodel.utils.model_dequant import dequantize_model
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    calib = calibration_texts()
    base_model = AutoModelForCausalLM.from_pretrained(text_base, dtype=torch.float32).eval()
    # GPTQModel writes per-run logs to ./logs/ (looper/loop_processor.py: _PROJECT_LOG_DIR): keep them out of the tree
    text_base, out_root = text_base.resolve(), out_root.resolve()
    scratch = tempfile.TemporaryDirectory(prefix="gptqmodel-cwd-")
    os.chdir(scratch.name)
    for name in names:
        spec = GPTQ_FIXTURES[name]
        out = out_root / name
        shutil.rmtree(out, ignore_errors=True)
        if spec["method"] == "gptq":
            qcfg = GPTQConfig(
                bits=spec["bits"],
                group_size=spec["group_size"],
                desc_act=spec["desc_act"],
                act_group_aware=False if spec["desc_act"] else None,
                offload_to_disk=False,
            )
        else:
            qcfg = AWQConfig(bits=spec["bits"], group_size=spec["group_size"], sym=spec["sym"], offload_to_disk=False)
        log(f"{name}: GPTQModel.load(base, {type(qcfg).__name__}({spec})) + quantize({len(calib)} texts)")
        model = GPTQModel.load(str(text_base), qcfg, dtype=torch.float16, device="cpu")
        model.quantize(calib, batch_size=1)
        model.save(str(out))
        del model
        (out / "quant_log.csv").unlink(missing_ok=True)  # per-module losses and timings: not part of a checkpoint

        # ---- dequantized float32 twin, by GPTQModel's own dequantizers
        cfg = json.loads((out / "config.json").read_text())
        qc = cfg["quantization_config"]
        checks = {}
        with tempfile.TemporaryDirectory() as tmp:
            offline = Path(tmp) / "offline"
            dequantize_model(out, offline, target_dtype=torch.float32)
            with safe_open(offline / "model.safetensors", "pt") as f:
                offline_sd = {k: f.get_tensor(k) for k in f.keys()}
        with safe_open(out / "model.safetensors", "pt") as f:
            packed = {k: f.get_tensor(k) for k in f.keys()}
        prefixes = sorted(k[: -len(".qweight")] for k in packed if k.endswith(".qweight"))
        if spec["method"] == "gptq":
            state = {k: v.float() for k, v in offline_sd.items()}
            checks["dequantizer"] = "gptqmodel.utils.model_dequant.dequantize_model(target_dtype=float32)"
            # the kernel's own dequantizer as a second opinion (TorchLinear.dequantize_weight, float32 scales)
            kernel = GPTQModel.load(str(out), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
            mods = {n: m for n, m in kernel.model.named_modules() if isinstance(m, BaseQuantLinear)}
            err = 0.0
            for p in prefixes:
                m = mods[p]
                m.scales = m.scales.float()
                if hasattr(m, "clear_weight_cache"):
                    m.clear_weight_cache()
                w = m.dequantize_weight().T.float()
                err = max(err, float((w - state[p + ".weight"]).abs().max()))
            checks["max_abs_diff_offline_vs_TorchLinear.dequantize_weight"] = err
            g_idx_trivial = all(
                torch.equal(
                    packed[p + ".g_idx"].long(), torch.arange(packed[p + ".g_idx"].numel()) // spec["group_size"]
                )
                for p in prefixes
            )
            checks["g_idx_is_arange_div_group"] = g_idx_trivial
            # GPTQ error vs the unquantized base weights, in units of each weight's scale
            worst = 0.0
            for p in prefixes:
                w0 = base_model.get_submodule(p).weight.detach()
                s = packed[p + ".scales"].float()[packed[p + ".g_idx"].long()].T  # [out, in]
                worst = max(worst, float(((state[p + ".weight"] - w0).abs() / s).max()))
            checks["max_abs_err_vs_base_in_scales"] = worst
            del kernel
        else:
            state = {
                k: v.float() if v.is_floating_point() else v
                for k, v in packed.items()
                if not k.endswith((".qweight", ".qzeros", ".scales"))
            }
            for p in prefixes:
                w = dequantize_gemm(
                    packed[p + ".qweight"],
                    packed[p + ".qzeros"],
                    packed[p + ".scales"].float(),
                    spec["bits"],
                    spec["group_size"],
                )
                state[p + ".weight"] = w.T.contiguous().float()
            checks["dequantizer"] = "gptqmodel.quantization.awq.utils.packing_utils.dequantize_gemm (float32 scales)"
            checks["max_abs_diff_offline_dequantize_model_vs_dequantize_gemm"] = max(
                float((offline_sd[p + ".weight"].float() - state[p + ".weight"]).abs().max()) for p in prefixes
            )
        dq_dir = out / "dequantized"
        hf_cfg = AutoConfig.from_pretrained(out)
        del hf_cfg.quantization_config
        hf_cfg.dtype = torch.float32
        dq = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
        missing, unexpected = dq.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise AssertionError(f"dequantized state dict: missing {missing}, unexpected {unexpected}")
        dq.generation_config = AutoModelForCausalLM.from_pretrained(text_base).generation_config
        dq.save_pretrained(dq_dir)
        AutoTokenizer.from_pretrained(out).save_pretrained(dq_dir)
        del dq

        # ---- oracles
        prompts = build_prompts(out, "text")
        dq_model = AutoModelForCausalLM.from_pretrained(dq_dir, dtype=torch.float32).eval()
        results = {"transformers_dequantized_fp32": [greedy(dq_model, dq_dir, p) for p in prompts]}
        checks["hf_generate_agrees_with_loop"] = hf_generate_agrees(
            dq_model, dq_dir, prompts, results["transformers_dequantized_fp32"]
        )
        checks.update(first_step_vs_base(dq_model, base_model, dq_dir, prompts))
        backend = BACKEND.TORCH if spec["method"] == "gptq" else BACKEND.AWQ_TORCH
        kernel = GPTQModel.load(str(out), backend=backend, device="cpu", dtype=torch.float16)
        kinds = sorted({type(m).__name__ for m in kernel.model.modules() if isinstance(m, BaseQuantLinear)})
        if spec["method"] == "gptq":
            kernel.model.float()  # TorchLinear dequantizes with the scales' dtype and matmuls in the input's dtype
            for m in kernel.model.modules():
                if isinstance(m, BaseQuantLinear) and hasattr(m, "clear_weight_cache"):
                    m.clear_weight_cache()
            kernel_dtype = "float32"
        else:
            kernel_dtype = "float16 (AwqTorchLinear.forward computes in float16 for float32 inputs)"
        results["gptqmodel_kernel"] = [greedy(kernel.model, out, p) for p in prompts]
        checks["gptqmodel_kernel"] = {
            "qlinear": kinds,
            "dtype": kernel_dtype,
            **compare(results["transformers_dequantized_fp32"], results["gptqmodel_kernel"]),
        }
        del kernel
        ref = {
            "fixture": name,
            "format": spec["method"],
            "base": "text",
            "spec": spec,
            "quantization_config": qc,
            "made_by": {
                "tool": "gptqmodel GPTQModel.load + quantize + save",
                "calibration": calib,
                **versions("gptqmodel", "transformers", "torch"),
            },
            "oracle": (
                "transformers AutoModelForCausalLM on dequantized/ (float32, dequantized by GPTQModel's own "
                "function, see checks.dequantizer); full-recompute greedy loop, no EOS stop"
            ),
            "dtype": "float32",
            "max_new_tokens": MAX_NEW_TOKENS,
            "primary": "transformers_dequantized_fp32",
            "prompts": prompts,
            "results": results,
            "checks": checks,
        }
        write_reference(out, ref)
        log(f"{name}: {dir_size(out) / 1024:.0f} KiB, checks {json.dumps(checks)}")


# ------------------------------------------------------------------------------------------------- verify / describe


def verify(out_root: Path, names: list[str]) -> int:
    """Re-run each fixture's oracle with the transformers of THIS venv and compare with reference.json."""
    import torch
    from transformers import AutoModelForCausalLM

    bad = 0
    for name in names:
        d = out_root / name
        ref = json.loads((d / "reference.json").read_text())
        try:
            if ref["format"] == "compressed-tensors":
                as_saved = try_load_as_saved(d, ref["base"], ref["prompts"])
                print(f"{name}: transformers loads it as saved: {as_saved}")
                tmp = tempfile.mkdtemp()
                model = load_ct(ct_oracle_dir(d, ref["base"], Path(tmp)) if as_saved != "ok" else d, ref["base"])
                got = {"transformers": [greedy(model, d, p) for p in ref["prompts"]]}
                if "transformers_weights_only" in ref["results"]:
                    for m in model.modules():
                        m.quantization_enabled = False
                    got["transformers_weights_only"] = [greedy(model, d, p) for p in ref["prompts"]]
                want = {k: ref["results"][k] for k in got}
            else:
                model = AutoModelForCausalLM.from_pretrained(d / "dequantized", dtype=torch.float32).eval()
                got = {"transformers_dequantized_fp32": [greedy(model, d / "dequantized", p) for p in ref["prompts"]]}
                want = {k: ref["results"][k] for k in got}
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name}: FAILED to load/generate: {type(e).__name__}: {str(e)[:300]}")
            bad += 1
            continue
        for k in got:
            c = compare(want[k], got[k])
            ok = all(c["tokens_equal_per_prompt"])
            bad += not ok
            print(f"{name} [{k}]: {'OK' if ok else 'MISMATCH'} {json.dumps(c)}")
    return bad


def describe(out_root: Path, names: list[str]) -> None:
    """One linear layer's tensors (names, shapes, dtypes) and the quantization_config of each fixture."""
    from safetensors import safe_open

    for name in names:
        d = out_root / name
        if not (d / "config.json").exists():
            continue
        cfg = json.loads((d / "config.json").read_text())
        qc = dict(cfg.get("quantization_config", {}))
        files = sorted(str(f.relative_to(d)) for f in d.rglob("*") if f.is_file())
        print(f"### {name}  ({dir_size(d) / 1024:.0f} KiB)\n\nFiles: {', '.join(files)}\n\n```")
        with safe_open(d / "model.safetensors", "pt") as f:
            for k in sorted(f.keys()):
                if ".layers.0.mlp.down_proj." in k or ".layers.0.self_attn.k_proj." in k:
                    t = f.get_slice(k)
                    print(f"{k:60s} {str(t.get_shape()):12s} {t.get_dtype()}")
        print("```\n\n`quantization_config` (one top-level key a line):\n\n```json")
        print("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in qc.items()) + "\n}")
        print("```\n")


# -------------------------------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", help="fixture names (default: all)")
    ap.add_argument(
        "--gptq-python",
        type=Path,
        default=DEFAULT_GPTQ_PYTHON,
        help="python of the venv with gptqmodel (default .venv-gptq/bin/python)",
    )
    ap.add_argument("--skip-gptq", action="store_true", help="make only the compressed-tensors fixtures")
    ap.add_argument("--work", type=Path, help="where to keep the base checkpoints (default: a temp dir)")
    ap.add_argument("--stage", choices=["all", "gptq"], default="all", help=argparse.SUPPRESS)
    ap.add_argument("--text-base", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--verify", action="store_true", help="re-run the oracles in this venv and compare")
    ap.add_argument("--describe", action="store_true", help="print one linear's tensors + quantization_config")
    args = ap.parse_args()
    all_names = list(CT_FIXTURES) + list(GPTQ_FIXTURES)
    names = args.only or all_names
    unknown = set(names) - set(all_names)
    if unknown:
        ap.error(f"unknown fixtures {sorted(unknown)}; choose from {all_names}")

    if args.verify or args.describe:
        present = [n for n in names if (args.out / n / "reference.json").exists()]
        if args.describe:
            describe(args.out, present)
            return 0
        return 1 if verify(args.out, present) else 0
    if args.stage == "gptq":
        gptq_stage(args.text_base, args.out, [n for n in names if n in GPTQ_FIXTURES])
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="quant-fixtures-") as tmp:
        work = args.work or Path(tmp)
        bases = build_bases(work)
        for name in names:
            if name in CT_FIXTURES:
                make_ct(name, bases, args.out)
        gptq_names = [n for n in names if n in GPTQ_FIXTURES]
        if gptq_names and not args.skip_gptq:
            if not args.gptq_python.exists():
                log(f"SKIPPING {gptq_names}: no {args.gptq_python} (make quant-fixtures creates .venv-gptq)")
            else:
                cmd = [
                    str(args.gptq_python),
                    "-m",
                    "tools.make_quant_fixtures",
                    "--stage",
                    "gptq",
                    "--text-base",
                    str(bases["text"]),
                    "--out",
                    str(args.out),
                    "--only",
                    *gptq_names,
                ]
                log("GPTQ/AWQ stage: " + " ".join(cmd))
                subprocess.run(cmd, check=True, cwd=REPO)
    total = 0
    for name in all_names:
        d = args.out / name
        if d.exists():
            size = dir_size(d)
            total += size
            log(f"{name:28s} {size / 1024:8.0f} KiB")
    log(f"{'total':28s} {total / 1024:8.0f} KiB ({total / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
