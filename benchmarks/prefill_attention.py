"""Prefill attention on a GPU: the Triton paged kernel against flash SDPA on contiguous K/V, in TFLOP/s.

The shapes: bf16, 32 query / 8 KV heads, head dim 128, cache block 16, fresh causal prompts of
B x L = 1 x 4096, 8 x 2048 and 32 x 512. The causal FLOPs (4 * B * Hq * D * L * (L + 1) / 2) are the same for both,
so the ratio column is Triton's speed as a fraction of flash's. `--sweep` also times every candidate launch shape
(`PrefillTile`) per case and prints the fastest.

    python -m benchmarks.prefill_attention [--dtype bfloat16] [--iters 20] [--sweep] [--cases 1x4096 8x2048]

On a machine without CUDA, `--device cpu` with TRITON_INTERPRET=1 runs the same code on tiny cases (a smoke run:
the interpreter's timings mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import torch.nn.functional as F

from vlserve.kernels.triton_prefill import PrefillTile, paged_prefill_attention_triton, prefill_tile

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CASES = ["1x4096", "8x2048", "32x512"]
SWEEP = [
    PrefillTile(rows, block_n, warps, stages)
    for rows, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
]


def _time_ms(fn, device: torch.device, iters: int) -> float:
    """Median of `iters` timed calls after three warm-up calls (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return sorted(samples)[len(samples) // 2]


def _case(batch: int, length: int, dtype: torch.dtype, device: torch.device):
    """Contiguous q/k/v [B, H, L, D] for SDPA, and the same keys and values scattered over shuffled cache blocks."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, HQ, length, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(batch, HKV, length, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(batch, HKV, length, HEAD_DIM, generator=gen).to(dtype)
    blocks = -(-length // BLOCK_SIZE)
    tables = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).to(torch.int32)
    pad = blocks * BLOCK_SIZE - length
    k_cache = torch.empty(batch * blocks, BLOCK_SIZE, HKV, HEAD_DIM, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    k_cache[tables.reshape(-1).long()] = F.pad(k.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(
        -1, BLOCK_SIZE, HKV, HEAD_DIM
    )
    v_cache[tables.reshape(-1).long()] = F.pad(v.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(
        -1, BLOCK_SIZE, HKV, HEAD_DIM
    )
    query = q.transpose(1, 2).reshape(batch * length, HQ, HEAD_DIM).contiguous()  # [T, Hq, D]
    qsl = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32)
    seq_lens = torch.full((batch,), length, dtype=torch.int32)
    group = HQ // HKV
    k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # flash SDPA wants Hq heads
    tensors = (q, k_full, v_full, query, k_cache, v_cache, tables, qsl, seq_lens)
    return tuple(t.to(device) for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time every candidate tile per case")
    parser.add_argument("--cases", nargs="+", default=CASES, help="BxL per case (default: the shapes above)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here (use --device cpu with TRITON_INTERPRET=1 for a smoke run)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    default = prefill_tile(HEAD_DIM, dtype, device)
    print(
        f"{name}, torch {torch.__version__}, {args.dtype}, Hq={HQ} Hkv={HKV} D={HEAD_DIM} BS={BLOCK_SIZE}; "
        f"median of {args.iters}; default tile {default}"
    )
    print("| case | flash SDPA ms | TFLOP/s | Triton paged ms | TFLOP/s | Triton / flash |")
    print("|---|---|---|---|---|---|")
    scale = HEAD_DIM**-0.5
    with torch.inference_mode():
        for case in args.cases:
            batch, length = (int(x) for x in case.split("x"))
            q, k, v, query, k_cache, v_cache, tables, qsl, seq_lens = _case(batch, length, dtype, device)
            flops = 4 * batch * HQ * HEAD_DIM * length * (length + 1) / 2

            def flash():
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

            def triton_paged(tile=None):
                return paged_prefill_attention_triton(
                    query, k_cache, v_cache, tables, qsl, seq_lens, scale, max_query_len=length, tile=tile
                )

            expected = flash().transpose(1, 2).reshape(-1, HQ, HEAD_DIM)
            torch.testing.assert_close(triton_paged().float(), expected.float(), atol=2e-2, rtol=2e-2)
            t_flash = _time_ms(flash, device, args.iters)
            t_triton = _time_ms(triton_paged, device, args.iters)
            print(
                f"| {batch} x {length} | {t_flash:.3f} | {flops / t_flash / 1e9:.1f} | {t_triton:.3f} | "
                f"{flops / t_triton / 1e9:.1f} | {t_flash / t_triton:.2f}x |",
                flush=True,
            )
            if args.sweep:
                timed = []
                for tile in SWEEP:
                    try:
                        torch.testing.assert_close(triton_paged(tile).float(), expected.float(), atol=2e-2, rtol=2e-2)
                        timed.append((_time_ms(lambda: triton_paged(tile), device, args.iters), tile))
                    except Exception as exc:  # a shape this GPU cannot run (shared memory): report and go on
                        print(f"    {tile}: {type(exc).__name__}: {str(exc)[:100]}")
                for ms, tile in sorted(timed, key=lambda x: x[0])[:5]:
                    print(f"    {tile}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s, {t_flash / ms:.2f}x flash")


if __name__ == "__main__":
    main()
