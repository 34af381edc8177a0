"""INT8 vision towers (`mm_encoder_quantization="int8"`) against the bf16 tower: embedding error, tower time, and the
demo model's greedy agreement.

1. Towers: one with Qwen2-VL-2B's vision shapes (depth 32, width 1280, 16 heads, MLP ratio 4, patch 14, merge 2,
   out 1536; seeded random weights, normal std 0.02 as HF's initializer, built here: no checkpoint) and the demo
   model's own tower (`vlserve/demo/model`, its trained weights). Each in bf16, and a copy quantized by
   `quantize_encoder_linears` (W8A8: int8 weights per output channel, int8 activations per token), both packed as
   the model runner packs towers (`pack_linears_for_cpu(..., many_rows=...)`). Inputs: one image of `--sizes`
   pixels a side (448 -> 1024 patch rows, 896 -> 4096): seeded normal pixel rows for the 2B-shaped tower, a demo
   world picture through the demo's HF image processor for the demo tower. Printed per tower and size: relative
   L2 error ||int8 - bf16|| / ||bf16|| and cosine of the merged embeddings, and the median milliseconds of a tower
   call in bf16 and int8, and the fastest (alternating, after one warm-up call each; the fastest for a machine
   shared with other jobs).
2. The demo model's held-out eval (`vlserve.demo.held_out`, what `python -m training.eval` scores): every item
   answered greedily by `LLM(demo, dtype=--eval-dtype)` (bf16 by default) with its float tower and with INT8
   towers; printed: the fraction of items whose greedy token ids are equal, and each one's accuracy
   (`training.eval.score`).

    python -m benchmarks.int8_towers [--sizes 448 896] [--iters 3] [--per-form 50] [--eval-dtype bfloat16]
        [--skip-2b] [--skip-eval] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from vlserve.encoders import Qwen2VisionTower
from vlserve.encoders.vision_layers import VisionTowerConfig
from vlserve.kernels.packed_linear import pack_linears_for_cpu
from vlserve.models.quantization.encoder_int8 import quantize_encoder_linears
from vlserve.worker.cpu_allocator import tune_cpu_allocator

PATCH, TEMPORAL, MERGE = 14, 2, 2
QWEN2_VL_2B = VisionTowerConfig(
    depth=32, width=1280, num_heads=16, mlp_hidden=4 * 1280, hidden_act="quick_gelu", out_dim=1536
)


class _Towered(nn.Module):
    """A model whose one encoder part is `visual` (what `quantize_encoder_linears` walks)."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.visual = tower

    def encoder_parts(self) -> list[nn.Module]:
        return [self.visual]


def random_2b_tower(seed: int = 0) -> Qwen2VisionTower:
    """Qwen2-VL-2B's vision shapes with seeded random weights (normal std 0.02, biases 0, norms 1), float32."""
    return random_qwen2_tower(QWEN2_VL_2B, seed)


def random_qwen2_tower(cfg, seed: int = 0) -> Qwen2VisionTower:
    """A Qwen2-VL tower of `cfg`'s shapes with seeded random weights (normal std 0.02, biases 0, norms 1), float32."""
    torch.manual_seed(seed)
    tower = Qwen2VisionTower(cfg)
    for name, p in tower.named_parameters():
        if "norm" in name or "ln_q" in name:
            nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
        else:
            nn.init.normal_(p, std=0.02)
    return tower


def demo_tower() -> Qwen2VisionTower:
    """The demo model's trained tower, float32 as shipped."""
    from transformers import AutoConfig

    from vlserve.demo import default_model_path
    from vlserve.models import load_model

    path = default_model_path()
    return load_model(path, AutoConfig.from_pretrained(path), torch.float32, "cpu").visual


def float_and_int8(tower: nn.Module, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """(`tower` cast to dtype, an INT8 copy of it), both packed as the runner packs towers."""
    ref = tower.to(dtype).eval()  # (in place: the 2B-shaped tower is 2.7 GB in float32)
    quant = _Towered(copy.deepcopy(ref)).eval()
    quantize_encoder_linears(quant, "int8")
    pack_linears_for_cpu(ref, many_rows=[ref])
    pack_linears_for_cpu(quant, many_rows=[quant.visual])
    return ref, quant.visual


def random_pixels(size: int, seed: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Normal pixel rows `[P, 3*tp*p*p]` of one size x size image and its grid."""
    side = size // PATCH
    torch.manual_seed(seed)
    return torch.randn(side * side, 3 * TEMPORAL * PATCH * PATCH), (1, side, side)


def demo_pixels(size: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A demo world picture resized to size x size, through the demo's HF image processor."""
    import random

    from vlserve.demo import default_model_path, world
    from vlserve.multimodal.processor import load_hf_processor

    image = world.render_image(world.sample_scene(random.Random(size))).resize((size, size))
    processor = load_hf_processor(default_model_path()).image_processor
    out = processor(images=[image], return_tensors="pt", min_pixels=size * size, max_pixels=size * size)
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def compare_towers(name: str, tower: nn.Module, inputs, dtype: torch.dtype, iters: int) -> None:
    """Print error and times of the INT8 copy of `tower` against it in `dtype`, per input."""
    ref, quant = float_and_int8(tower, dtype)
    for size, (pixels, grid) in inputs:
        pixels = pixels.to(dtype)
        times: dict[str, list[float]] = {"bf16": [], "int8": []}
        with torch.inference_mode():
            a, b = ref(pixels, [grid]).float(), quant(pixels, [grid]).float()  # warm-up; [P / 4, O]
            for _ in range(iters):
                for label, model in (("bf16", ref), ("int8", quant)):
                    t0 = time.perf_counter()
                    model(pixels, [grid])
                    times[label].append(time.perf_counter() - t0)
        rel = float((b - a).norm() / a.norm())
        cos = float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        fastest = {k: 1e3 * min(v) for k, v in times.items()}
        print(
            f"{name:<12} {size:>4}px {pixels.shape[0]:>5} rows | rel L2 {rel:.4f} cos {cos:.6f} | median "
            f"{dtype_name(dtype)} {ms['bf16']:.1f} ms, int8 {ms['int8']:.1f} ms ({ms['bf16'] / ms['int8']:.2f}x) | "
            f"min {fastest['bf16']:.1f} / {fastest['int8']:.1f} ms ({fastest['bf16'] / fastest['int8']:.2f}x)"
        )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def greedy_ids(llm, items: list[dict], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of every held-out item (one chat batch)."""
    from vlserve import SamplingParams
    from vlserve.demo.held_out import messages_for

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.chat([messages_for(it, "vlserve") for it in items], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def demo_agreement(per_form: int, dtype: str) -> None:
    """Greedy agreement of INT8 towers with the float towers on the demo eval, and each one's accuracy."""
    from training.eval import MAX_NEW_TOKENS, score
    from vlserve import LLM
    from vlserve.demo import world
    from vlserve.demo.held_out import held_out_set

    items = held_out_set(per_form)
    answers = {}
    for label, quant in (("float", None), ("int8", "int8")):
        llm = LLM(dtype=dtype, device="cpu", mm_encoder_quantization=quant)
        t0 = time.perf_counter()
        ids = greedy_ids(llm, items, MAX_NEW_TOKENS)
        texts = [llm.get_tokenizer().decode(i, skip_special_tokens=True) for i in ids]
        answers[label] = ids
        acc = score(items, texts, world.FORMS)
        print(
            f"demo eval, {dtype} model, {label} towers: accuracy {acc['overall']:.4f} over {len(items)} items "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        del llm
    same = sum(a == b for a, b in zip(answers["float"], answers["int8"]))
    print(f"greedy agreement (int8 towers == {dtype} towers, token ids): {same}/{len(items)} = {same / len(items):.4f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="INT8 vision towers vs bf16: error, time, demo greedy agreement.")
    p.add_argument("--sizes", type=int, nargs="+", default=[448, 896], help="image side in pixels")
    p.add_argument("--iters", type=int, default=3, help="timed calls per tower and size (median)")
    p.add_argument("--per-form", type=int, default=50, help="demo eval items per question form")
    p.add_argument("--eval-dtype", default="bfloat16", help="the demo model's dtype in the eval")
    p.add_argument("--skip-2b", action="store_true", help="leave out the Qwen2-VL-2B-shaped tower")
    p.add_argument("--skip-eval", action="store_true", help="leave out the demo eval")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tune_cpu_allocator()
    dtype = torch.bfloat16
    print(f"torch threads {torch.get_num_threads()}; towers in {dtype_name(dtype)} vs W8A8 int8")
    if not a.skip_2b:
        compare_towers("qwen2-vl-2b", random_2b_tower(), [(s, random_pixels(s, s)) for s in a.sizes], dtype, a.iters)
    compare_towers("demo", demo_tower(), [(s, demo_pixels(s)) for s in a.sizes], dtype, a.iters)
    if not a.skip_eval:
        demo_agreement(a.per_form, a.eval_dtype)


if __name__ == "__main__":
    main()
