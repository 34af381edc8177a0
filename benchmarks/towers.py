"""Encoder tower throughput per family: vlserve's tower against transformers' on the same random weights, float32 and
bf16, in one run.

For each family, transformers' tower is built from its config class (random init, SDPA attention) and ours from the
same config with HF's weights loaded by name, cast to the dtype, then packed for the CPU linear kernel
(`pack_linears_for_cpu`, as the model runner does; 0 packed where this CPU has no kernel). Both take the same input
(one 448x448 image, or 30 s of 128-bin mel frames for audio) and are timed call by call, alternating (so the
machine's drift hits both), medians after one warm-up call each. FLOPs of one call are counted once per family by
`torch.utils.flop_counter.FlopCounterMode` on HF's float32 tower with eager attention (the counter does not see
CPU SDPA's kernel); both GFLOP/s columns divide that count by each tower's time. Parity: max |ours - HF| / max |HF|
on the same call in the same dtype. What each family compares:

- qwen2_vl, qwen2_5_vl: the merger's output (`pooler_output` on transformers 5.x); Qwen2.5-VL attends in windows of
  112 px with full attention at every 4th block (the last block where depth < 4).
- clip: the last layer's hidden states (HF's `last_hidden_state`, before post_layernorm, class token included).
- siglip: the last layer's hidden states after post_layernorm (HF's `last_hidden_state`; no pooling head), so ours
  runs its post_layernorm too.
- audio: Qwen2-Audio's Whisper-style encoder over the full 3000-frame window; "patches" counts the 1500 positions
  after the stride-2 conv stem.

    python -m benchmarks.towers [--families qwen2_vl clip ...] [--dtypes float32 bfloat16] [--depth 8]
        [--width 512] [--head-dim 64] [--image-size 448] [--iters 5] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from vlserve.kernels import cpu_linear
from vlserve.kernels.packed_linear import pack_linears_for_cpu
from vlserve.worker.cpu_allocator import tune_cpu_allocator

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "clip", "siglip", "audio")
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}  # parity: max |ours - HF| / max |HF|
PATCH = 14
MEL_BINS, AUDIO_POSITIONS = 128, 1500  # Qwen2-Audio: 3000 mel frames (30 s) -> 1500 positions after the stem


@dataclass(frozen=True)
class Sizes:
    depth: int
    width: int
    image_size: int
    head_dim: int = 64

    @property
    def heads(self) -> int:
        return max(self.width // self.head_dim, 1)


@dataclass
class Family:
    """One family's HF tower (float32, SDPA), how to build ours from it, its input and how to call each."""

    hf: torch.nn.Module
    build_ours: Callable[[torch.nn.Module], torch.nn.Module]  # HF tower -> ours with its weights (float32)
    inputs: torch.Tensor
    call_ours: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    call_hf: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    patches: int


def _hf_output(out) -> torch.Tensor:
    """The merged embeddings of a Qwen tower: an output object on transformers 5.x, a tensor on 4.57."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


def _qwen(sizes: Sizes, v25: bool) -> Family:
    from vlserve.encoders import Qwen2_5VisionTower, Qwen2VisionTower, qwen2_5_vl_tower_config, qwen2_vl_tower_config

    common = dict(
        depth=sizes.depth,
        num_heads=sizes.heads,
        patch_size=PATCH,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
    )
    if v25:
        from transformers import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as M

        fullatt = [i for i in range(sizes.depth) if i % 4 == 3] or [sizes.depth - 1]
        cfg = Qwen2_5_VLVisionConfig(
            hidden_size=sizes.width,
            intermediate_size=4 * sizes.width,
            out_hidden_size=sizes.width,
            window_size=112,
            fullatt_block_indexes=fullatt,
            **common,
        )
        ours_cls, read = Qwen2_5VisionTower, qwen2_5_vl_tower_config
    else:
        from transformers import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as M

        cfg = Qwen2VLVisionConfig(embed_dim=sizes.width, hidden_size=sizes.width, mlp_ratio=4, **common)
        ours_cls, read = Qwen2VisionTower, qwen2_vl_tower_config
    hf = M._from_config(cfg, attn_implementation="sdpa").eval()
    side = sizes.image_size // PATCH
    grid = (1, side, side)
    pixels = torch.randn(side * side, 3 * 2 * PATCH * PATCH)  # [P, C*tp*p*p], the processor's rows

    def build(hf_tower):
        ours = ours_cls(read(hf_tower.config))
        ours.load_state_dict(hf_tower.state_dict(), strict=True)
        return ours

    return Family(
        hf,
        build,
        pixels,
        lambda m, x: m(x, [grid]),
        lambda m, x: _hf_output(m(x, grid_thw=torch.tensor([grid]))),
        side * side,
    )


def _vit(sizes: Sizes, siglip: bool) -> Family:
    from vlserve.encoders.clip_vision import ClipVisionTower, VitConfig
    from vlserve.encoders.siglip_vision import SiglipVisionTower

    common = dict(
        hidden_size=sizes.width,
        intermediate_size=4 * sizes.width,
        num_hidden_layers=sizes.depth,
        num_attention_heads=sizes.heads,
        image_size=sizes.image_size,
        patch_size=PATCH,
    )
    if siglip:
        from transformers import SiglipVisionConfig
        from transformers import SiglipVisionModel as M

        cfg, ours_cls = SiglipVisionConfig(vision_use_head=False, **common), SiglipVisionTower
    else:
        from transformers import CLIPVisionConfig
        from transformers import CLIPVisionModel as M

        cfg, ours_cls = CLIPVisionConfig(**common), ClipVisionTower
    hf = M._from_config(cfg, attn_implementation="sdpa").eval()
    layers = [sizes.depth]

    def build(hf_tower):
        ours = ours_cls(VitConfig.from_hf(hf_tower.config))
        loaded = ours.load_weights(hf_tower.state_dict().items())  # 4.57 names carry `vision_model.`
        if loaded != ours.expected_weight_names():
            raise RuntimeError(f"weights not loaded: {sorted(ours.expected_weight_names() - loaded)}")
        return ours

    if siglip:  # HF's last_hidden_state is after post_layernorm
        call_ours = lambda m, x: m.post_layernorm(m(x, layers))  # noqa: E731
    else:
        call_ours = lambda m, x: m(x, layers)  # noqa: E731
    pixels = torch.randn(1, 3, sizes.image_size, sizes.image_size)
    return Family(
        hf, build, pixels, call_ours, lambda m, x: m(pixel_values=x).last_hidden_state, (sizes.image_size // PATCH) ** 2
    )


def _audio(sizes: Sizes) -> Family:
    from transformers import Qwen2AudioEncoderConfig
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder as M

    from vlserve.encoders import Qwen2AudioEncoder, qwen2_audio_encoder_config

    cfg = Qwen2AudioEncoderConfig(
        num_mel_bins=MEL_BINS,
        d_model=sizes.width,
        encoder_layers=sizes.depth,
        encoder_attention_heads=sizes.heads,
        encoder_ffn_dim=4 * sizes.width,
        max_source_positions=AUDIO_POSITIONS,
    )
    hf = M._from_config(cfg, attn_implementation="sdpa").eval()
    frames = 2 * AUDIO_POSITIONS

    def build(hf_tower):
        ours = Qwen2AudioEncoder(qwen2_audio_encoder_config(hf_tower.config))
        ours.load_state_dict(hf_tower.state_dict(), strict=True)
        return ours

    return Family(
        hf,
        build,
        torch.randn(1, MEL_BINS, frames),
        lambda m, x: m([x[0]], [frames]),
        lambda m, x: m(x).last_hidden_state[0],
        AUDIO_POSITIONS,
    )


def build_family(name: str, sizes: Sizes) -> Family:
    torch.manual_seed(0)
    if name in ("qwen2_vl", "qwen2_5_vl"):
        return _qwen(sizes, name == "qwen2_5_vl")
    if name in ("clip", "siglip"):
        return _vit(sizes, name == "siglip")
    return _audio(sizes)


def count_flops(fam: Family) -> int:
    """FLOPs of one HF call (float32), with eager attention so the counter sees the attention matmuls."""
    _set_attention(fam.hf, "eager")
    try:
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            fam.call_hf(fam.hf, fam.inputs)
    finally:
        _set_attention(fam.hf, "sdpa")
    return counter.get_total_flops()


def _set_attention(hf: torch.nn.Module, impl: str) -> None:
    if hasattr(hf, "set_attn_implementation"):  # transformers >= 4.56
        hf.set_attn_implementation(impl)
    else:  # older ones read the shared config at call time
        hf.config._attn_implementation = impl


def time_alternating(calls: dict[str, Callable[[], object]], iters: int) -> dict[str, float]:
    """Median seconds per call of each callable, called in turn (order flipped every round) after one warm-up."""
    for fn in calls.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for i in range(iters):
        for name in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def kernel_isa(dtype: torch.dtype) -> str:
    """The packed CPU linear's path for `dtype` on this machine ("none" without a kernel)."""
    if hasattr(cpu_linear, "cpu_linear_isa"):
        return cpu_linear.cpu_linear_isa(dtype) or "none"
    return "avx512" if cpu_linear.cpu_linear_kernel() is not None else "none"


def run_row(name: str, fam: Family, dtype: torch.dtype, flops: int, iters: int) -> dict:
    """Build ours and HF's at `dtype`, check parity, time both; the row's figures."""
    hf = copy.deepcopy(fam.hf).to(dtype)
    ours = fam.build_ours(fam.hf).to(dtype).eval()
    packed = pack_linears_for_cpu(ours, many_rows=[ours])  # a tower, as the runner packs it
    x = fam.inputs.to(dtype)
    with torch.inference_mode():
        expected = fam.call_hf(hf, x).float()
        got = fam.call_ours(ours, x).float()
        if got.shape != expected.shape:
            raise RuntimeError(f"{name}: ours gives {tuple(got.shape)}, HF {tuple(expected.shape)}")
        err = ((got - expected).abs().max() / expected.abs().max()).item()
        t = time_alternating({"ours": lambda: fam.call_ours(ours, x), "hf": lambda: fam.call_hf(hf, x)}, iters)
    return {
        "family": name,
        "dtype": str(dtype).removeprefix("torch."),
        "patches": fam.patches,
        "packed": packed,
        "ours_ms": t["ours"] * 1e3,
        "hf_ms": t["hf"] * 1e3,
        "patches_s": fam.patches / t["ours"],
        "ours_gflops": flops / t["ours"] / 1e9,
        "hf_gflops": flops / t["hf"] / 1e9,
        "speedup": t["hf"] / t["ours"],
        "err": err,
        "ok": err <= TOLERANCE[dtype],
    }


HEADER = (
    f"{'family':<11} {'dtype':<9} {'patches':>7} {'packed':>6} {'ours ms':>9} {'HF ms':>9} "
    f"{'ours patch/s':>12} {'ours GFLOP/s':>12} {'HF GFLOP/s':>10} {'ours/HF':>7}  parity (max|d|/max|HF|)"
)


def format_row(r: dict) -> str:
    verdict = "ok" if r["ok"] else "OVER TOLERANCE"
    return (
        f"{r['family']:<11} {r['dtype']:<9} {r['patches']:>7} {r['packed']:>6} {r['ours_ms']:>9.1f} "
        f"{r['hf_ms']:>9.1f} {r['patches_s']:>12.0f} {r['ours_gflops']:>12.1f} {r['hf_gflops']:>10.1f} "
        f"{r['speedup']:>6.2f}x  {r['err']:.2e} {verdict}"
    )


def summary(rows: list[dict], dtype: str) -> str:
    """Geometric mean of the speed-ups of one dtype's rows, their range, and both towers' total time."""
    rs = [r for r in rows if r["dtype"] == dtype]
    geo = math.exp(sum(math.log(r["speedup"]) for r in rs) / len(rs))
    lo, hi = min(rs, key=lambda r: r["speedup"]), max(rs, key=lambda r: r["speedup"])
    bad = [r["family"] for r in rs if not r["ok"]]
    return (
        f"summary {dtype}: ours/HF geomean {geo:.2f}x over {len(rs)} families (min {lo['speedup']:.2f}x "
        f"{lo['family']}, max {hi['speedup']:.2f}x {hi['family']}); ours {sum(r['ours_ms'] for r in rs):.1f} ms "
        f"vs HF {sum(r['hf_ms'] for r in rs):.1f} ms in all; parity "
        + (f"OVER TOLERANCE in {', '.join(bad)}" if bad else "ok")
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument(
        "--width", type=int, default=512, help="tower width; MLP 4x, heads of --head-dim (at least one)"
    )
    parser.add_argument("--head-dim", type=int, default=64, help="80: Qwen2-VL-2B's towers (width 1280, 16 heads)")
    parser.add_argument("--image-size", type=int, default=448, help="a multiple of 28 (Qwen merges 2x2 patches)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.image_size % (2 * PATCH) or args.image_size <= 0:
        parser.error(f"--image-size must be a positive multiple of {2 * PATCH}")
    if args.head_dim <= 0 or args.width % args.head_dim:
        parser.error("--width must be a multiple of --head-dim")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the comparison and print its table; the rows, for tests."""
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.threads:
        torch.set_num_threads(args.threads)
    tuned = tune_cpu_allocator()
    dtypes = [getattr(torch, d) for d in args.dtypes]
    sizes = Sizes(args.depth, args.width, args.image_size, args.head_dim)
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
        f"allocator tuning {'applied' if tuned else 'not applied'}; packed linear kernel: "
        + ", ".join(f"{str(d).removeprefix('torch.')} {kernel_isa(d)}" for d in dtypes)
    )
    print(
        f"towers: depth {sizes.depth}, width {sizes.width}, {sizes.heads} heads of {sizes.head_dim}, MLP {4 * sizes.width}, image "
        f"{sizes.image_size}x{sizes.image_size} (patch {PATCH}), audio {2 * AUDIO_POSITIONS} mel frames; "
        f"HF with SDPA; median of {args.iters} calls"
    )
    print(HEADER)
    rows = []
    for name in args.families:
        fam = build_family(name, sizes)
        flops = count_flops(fam)
        for dtype in dtypes:
            row = run_row(name, fam, dtype, flops, args.iters)
            rows.append(row)
            print(format_row(row), flush=True)
            if not row["ok"]:
                msg = (
                    f"!!! WARNING: {name} {row['dtype']}: ours differs from HF by {row['err']:.2e} of HF's "
                    f"output scale (tolerance {TOLERANCE[dtype]:.0e}) !!!"
                )
                print(msg, flush=True)
                print(msg, file=sys.stderr)
    for d in args.dtypes:
        print(summary(rows, d))
    print(" ".join(["command: python -m benchmarks.towers", shlex.join(argv)]).rstrip())
    return rows


if __name__ == "__main__":
    main()
