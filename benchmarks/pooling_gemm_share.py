"""Time in the linear layers' GEMMs on the pooling benchmark's workloads: how much of a pass no engine running the
same GEMM libraries can save (HF's: a ceiling on vlserve / HF; vlserve's: a ceiling on any further speed-up of its
own, and so on vlserve / vLLM-CPU when both run the same GEMMs).

    python -m benchmarks.pooling_gemm_share [--models clip qwen2_vl] [--dtype bfloat16 float32] [--images 64]
        [--texts 0] [--runners hf vlserve]

Builds (or reuses) benchmarks/pooling.py's checkpoints and item sets under --workdir, runs each runner (HF's
`HfRunner` in batches of 16; vlserve's `EngineRunner`, one `embed` call per workload as in the benchmark) once to warm
up and once under torch.profiler, and prints per runner, model, dtype and workload: the wall time, the self time of
the linears (`aten::addmm` / `aten::mm` / `mkldnn::_linear_pointwise`, and vlserve's own `vlserve::cpu_linear*`
kernels) and of convolutions, and the linears' share of the wall time; with the shapes the profiler records, the
linears' GFLOP and rate. With both runners, per workload: the floor of any pass over vlserve's linear FLOPs (its
tokens, unpadded) at this CPU's arithmetic peak (`benchmarks.cpu_peak`), against half of HF's wall time, the time
a pass 2x HF's speed must take.
"""

from __future__ import annotations

import argparse
import functools
import os

from benchmarks.linear_flops import profile_linears
from benchmarks.pooling import prepare_sets
from benchmarks.pooling_checkpoints import clip_checkpoint, qwen2_vl_embedder


def _load_images(path: str | None) -> list:
    import numpy as np
    from PIL import Image

    if not path:
        return []
    with np.load(path) as arrays:
        return [Image.fromarray(arrays[str(i)]) for i in range(len(arrays.files))]


def main() -> None:
    from benchmarks.pooling import MAX_MODEL_LEN
    from benchmarks.pooling_child import EngineRunner, HfRunner

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["clip", "qwen2_vl"], choices=["clip", "qwen2_vl"])
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--texts", type=int, default=0)
    p.add_argument("--runners", nargs="+", default=["hf"], choices=["hf", "vlserve"])
    p.add_argument("--workdir", default=os.path.expanduser("~/.cache/vlserve-bench/pooling"))
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    # (family, dtype, workload, runner) -> (wall seconds, linear GFLOP)
    results: dict[tuple[str, str, str, str], tuple[float, float]] = {}
    for family in args.models:
        model = clip_checkpoint(args.workdir) if family == "clip" else qwen2_vl_embedder(args.workdir)
        workloads = prepare_sets(family, model, {"images": args.images, "texts": args.texts}, args.workdir, 0)
        for dtype, name in [(d, r) for d in args.dtype for r in args.runners]:
            spec = {"family": family, "model": model, "dtype": dtype, "hf_batch": 16, "runner": name}
            runner = HfRunner(spec) if name == "hf" else EngineRunner({**spec, "max_model_len": MAX_MODEL_LEN})
            for w in workloads:
                main_set, warm = w["sets"]["main"], w["sets"]["warmup"]
                runner.embed(warm["prompts"], _load_images(warm["images"]))
                images = _load_images(main_set["images"])
                prof = profile_linears(functools.partial(runner.embed, main_set["prompts"], images))
                wall, linear, gflop, conv = (prof[k] for k in ("wall_s", "linear_s", "linear_gflop", "conv_s"))
                print(
                    f"{name} {family} {dtype} {w['name']}: wall {wall:.3f} s; linear GEMMs {linear:.3f} s "
                    f"({linear / wall:.0%} of wall), {gflop:.1f} GFLOP at {gflop / linear:.0f} GFLOP/s; "
                    f"convolutions {conv:.3f} s",
                    flush=True,
                )
                results[(family, dtype, w["name"], name)] = (wall, gflop)
            del runner
    if {"hf", "vlserve"} <= set(args.runners):
        print_floors(results, args)


def print_floors(results: dict, args) -> None:
    """Per workload: vlserve's linear FLOPs at this CPU's peak against half of HF's wall time."""
    from benchmarks.cpu_peak import peak_gflops

    peaks = {d: peak_gflops(d) for d in args.dtype}
    print(
        f"this CPU's peak, {os.cpu_count()} threads (benchmarks.cpu_peak): "
        + str({d: f"{p:.0f} GFLOP/s" if p else None for d, p in peaks.items()})
    )
    for (family, dtype, workload, runner), (_, gflop) in results.items():
        if runner != "vlserve" or (family, dtype, workload, "hf") not in results or not peaks[dtype]:
            continue
        floor, budget = gflop / peaks[dtype], results[(family, dtype, workload, "hf")][0] / 2
        verdict = "out of reach: the linears alone take longer at peak" if floor > budget else "within reach"
        print(
            f"{family} {dtype} {workload}: linears {gflop:.1f} GFLOP, >= {floor:.3f} s at peak; "
            f"2x HF needs <= {budget:.3f} s: {verdict}"
        )


if __name__ == "__main__":
    main()
