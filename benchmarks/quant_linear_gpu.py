"""Quantized linear layers on a CUDA GPU: each route of `kernels.quant_linear_cuda` against a bf16 F.linear, for a
7B-like layer (K = 3584; N = 18944, an MLP up projection, and N = 3584, an attention output) at M = 1, 16, 128 and
2048 rows.

Per route and M: the route `quant_linear_cuda` took ("rowwise", "blockwise", "dequant", ...), median milliseconds of
eager calls (launch overhead included, as in an uncaptured step) and of the same call replayed from a CUDA graph,
TFLOP/s (2 M N K over the graph time), the speedup over bf16 (graph times), and the largest error against the
route's float32 reference in `quant_linear`, relative to the reference's largest |value| (a sanity check: this
script is the first thing that runs these routes on a GPU).

Routes: W8A8 INT8 (`torch._int_mm`), FP8 with per-token x and per-channel W scales (`torch._scaled_mm` row-wise),
FP8 with 1x128 x groups and 128x128 W blocks (`scaled_mm` blockwise on sm90 with CUDA >= 12.9, else dequantized),
W4A16 with groups of 128 through the Triton kernel (autotuned at its first call per M bucket; the tuning happens in
the warm-up, before timing).

Writes nothing but stdout: Triton's compile cache goes to a temporary directory removed at exit. Takes about a
minute on an H100 (most of it Triton compiling and tuning).

    python -m benchmarks.quant_linear_gpu [--rows 1 16 128 2048] [--n 18944 3584] [--k 3584]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

_CACHE = tempfile.TemporaryDirectory(prefix="vlserve-triton-")
os.environ["TRITON_CACHE_DIR"] = _CACHE.name  # before triton is imported: keep its cache off the disk we leave
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vlserve.kernels import quant_linear as QL  # noqa: E402
from vlserve.kernels import quant_linear_cuda as QC  # noqa: E402


def _time(fn, iters: int) -> tuple[float, float | None]:
    """Median ms of eager calls and of CUDA-graph replays (None if capture fails)."""
    import triton.testing

    eager = triton.testing.do_bench(fn, warmup=5, rep=iters, return_mode="median")
    try:
        graph = triton.testing.do_bench_cudagraph(fn, rep=iters, return_mode="median")
    except Exception as err:  # a route that syncs or allocates in a way capture refuses
        print(f"    (graph capture failed: {type(err).__name__}: {str(err)[:80]})")
        graph = None
    return eager, graph


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def _routes(n: int, k: int, g: torch.Generator) -> dict:
    """name -> (make the call for x, path name for x, reference for x) with weights for an [N, K] layer."""
    dev = g.device
    w_bf16 = (torch.randn(n, k, generator=g, device=dev) / k**0.5).to(torch.bfloat16)
    # W8A8: symmetric per-channel int8 of w
    i8_scale = w_bf16.float().abs().amax(dim=1) / 127  # [N]
    i8 = torch.round(w_bf16.float() / i8_scale[:, None]).clamp(-127, 127).to(torch.int8)
    # FP8 per-channel, and per 128x128 block
    f8_scale = w_bf16.float().abs().amax(dim=1) / QL.FP8_MAX  # [N]
    f8 = (w_bf16.float() / f8_scale[:, None]).to(torch.float8_e4m3fn)
    blocks = w_bf16.float().reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / QL.FP8_MAX  # [N/128, K/128]
    f8b = (w_bf16.float() / blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    # W4A16, groups of 128: random codes (the speed does not depend on them)
    q4 = torch.randint(0, 16, (n, k), generator=g, device=dev).to(torch.uint8)
    s4 = (torch.rand(n, k // 128, generator=g, device=dev) * 0.01 + 0.001).to(torch.bfloat16)
    z4 = torch.full((n, k // 128), 8, dtype=torch.uint8, device=dev)
    w4 = QC.prepare_wna16_cuda(QL.prepare_wna16(q4, s4, z4, 128, 4))

    def fp8w(scale, block, act, group):
        return QL.FP8Weights(f8 if block is None else f8b, scale, block, act, group)

    tok, blk = fp8w(f8_scale, None, "token", 0), fp8w(blocks, (128, 128), "group", 128)
    return {
        "bf16 F.linear": (
            lambda x: lambda: F.linear(x, w_bf16),
            lambda x: "cublas",
            lambda x: F.linear(x.float(), w_bf16.float()),
        ),
        "int8 W8A8": (
            lambda x: lambda: QC.int8_linear_cuda(x, i8, i8_scale, None),
            lambda x: QC.int8_path(x.shape[0], k, n),
            lambda x: _int8_ref(x, i8, i8_scale),
        ),
        "fp8 token/channel": (
            lambda x: lambda: QC.fp8_linear_cuda(x, f8, f8_scale, None, "token"),
            lambda x: QC.fp8_path(x, f8, f8_scale, None, "token"),
            lambda x: QL.fp8_linear_ref(x.float(), tok, None),
        ),
        "fp8 block128": (
            lambda x: lambda: QC.fp8_linear_cuda(x, f8b, blocks, (128, 128), "group", 128),
            lambda x: QC.fp8_path(x, f8b, blocks, (128, 128), "group", 128),
            lambda x: QL.fp8_linear_ref(x.float(), blk, None),
        ),
        "w4a16 g128": (
            lambda x: lambda: QC.wna16_linear_cuda(x, w4, None),
            lambda x: "triton",
            lambda x: QL.wna16_linear_ref(x.float(), q4, s4, z4, 128, None, None),
        ),
    }


def _int8_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # int8_linear_ref's math with a float64 matmul (exact for these sums; CUDA has no int64 matmul)
    xq, xs = QL.quantize_rows_int8(x)
    return (xq.double() @ weight.double().t()).float() * xs * scale[None, :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128, 2048])
    parser.add_argument("--n", type=int, nargs="+", default=[18944, 3584])
    parser.add_argument("--k", type=int, default=3584)
    parser.add_argument("--rep", type=int, default=40, help="ms of timed calls per measurement")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    start = time.time()
    cap = torch.cuda.get_device_capability()
    print(f"{torch.cuda.get_device_name()} sm{cap[0]}{cap[1]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    g = torch.Generator(device="cuda").manual_seed(0)
    k = args.k
    for n in args.n:
        routes = _routes(n, k, g)
        print(f"\nK={k} N={n}")
        print(
            f"{'route':<18} {'M':>5} {'path':<10} {'eager ms':>9} {'graph ms':>9} {'TFLOP/s':>8} "
            f"{'vs bf16':>8} {'rel err':>8}"
        )
        for m in args.rows:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            base = None
            for name, (make, path, ref) in routes.items():
                try:
                    call = make(x)
                    out = call()  # warm-up: compiles and tunes the Triton kernel for this M bucket
                    torch.cuda.synchronize()
                    err = _rel_err(out, ref(x))
                    eager, graph = _time(call, args.rep)
                except Exception as e:  # report and go on: one broken route should not hide the others
                    print(f"{name:<18} {m:>5} FAILED {type(e).__name__}: {str(e)[:150]}")
                    continue
                t = graph if graph is not None else eager
                base = t if name.startswith("bf16") else base
                tflops = 2 * m * n * k / (t * 1e-3) / 1e12
                speed = f"{base / t:7.2f}x" if base else "      -"
                graph_s = f"{graph:9.4f}" if graph is not None else f"{'-':>9}"
                print(
                    f"{name:<18} {m:>5} {path(x):<10} {eager:9.4f} {graph_s} {tflops:8.1f} {speed:>8} {err:8.1e}",
                    flush=True,
                )
        del routes
        torch.cuda.empty_cache()
    print(f"\ndone in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
