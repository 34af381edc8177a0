"""Paged attention micro-benchmark.

CPU: the torch path (`*_ref`) and, for decode, the C++ kernel (`kernels.cpu_decode`, what the engine decodes with on
CPU) against `scaled_dot_product_attention` on contiguous K/V of the same size, i.e. the cost of paging. With CUDA:
Triton vs torch path vs SDPA, each timed per call inside a CUDA graph (as a decode step replays them; call by call
only where a function cannot be captured, named at the end).

    python -m benchmarks.paged_attention [--dtype float32|bfloat16] [--iters 20] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from vlserve.kernels.attention_ref import paged_attention_decode_ref, paged_prefill_attention_ref
from vlserve.kernels.cpu_decode import cpu_decode_supported, paged_attention_decode_cpu

HQ, HKV, HEAD_DIM, BLOCK_SIZE = 16, 4, 64, 16
# (batch, context, mixed): mixed draws each sequence's length uniformly from [ctx/16, ctx]; its SDPA
# baseline is a contiguous cache padded to the longest sequence, with a padding mask
DECODE_CASES = [(1, 1024, False), (16, 512, False), (64, 256, False), (64, 1024, False), (64, 1024, True)]
PREFILL_CASES = [(1, 0, 512), (4, 0, 256), (2, 1024, 256)]  # (sequences, cached prefix, new tokens)


GRAPH_CALLS = 20  # calls per captured CUDA graph when timing on a GPU
EAGER_ON_CUDA: list[str] = []  # functions that could not be captured, so were timed call by call


def _graph_ms(fn, device: torch.device, iters: int) -> float | None:
    """Per-call GPU time of `fn` replayed from a CUDA graph of GRAPH_CALLS calls, best of `iters` replays: what a
    decode step that replays its graph pays (no launcher overhead: Triton's Python launch costs tens of us, which
    timed call by call swamps a kernel of a few us). None when `fn` cannot be captured (a host sync inside)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
    except Exception:  # noqa: BLE001 - any capture failure means: time it eagerly
        torch.cuda.synchronize(device)
        return None
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / GRAPH_CALLS)
    return min(samples)


def _time_ms(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Best of `iters` timed calls after warm-up; the minimum is robust to noisy neighbours on shared CPUs. On CUDA
    the time per call inside a CUDA graph (`_graph_ms`), or call by call where the function cannot be captured."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        graphed = _graph_ms(fn, device, iters)
        if graphed is not None:
            return graphed
        EAGER_ON_CUDA.append(fn.__name__)
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return min(samples)


def _paged(batch: int, seq_len: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    """Random contiguous K/V [B, Hkv, S, D] and the same data scattered over shuffled cache blocks."""
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 8
    k = torch.randn(batch, HKV, seq_len, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(batch, HKV, seq_len, HEAD_DIM, generator=gen).to(dtype)
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    pad = blocks_per_seq * BLOCK_SIZE - seq_len
    k_blocks = F.pad(k.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(-1, BLOCK_SIZE, HKV, HEAD_DIM)
    v_blocks = F.pad(v.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(-1, BLOCK_SIZE, HKV, HEAD_DIM)
    k_cache[tables.reshape(-1)] = k_blocks
    v_cache[tables.reshape(-1)] = v_blocks
    to = dict(device=device)
    return k.to(**to), v.to(**to), k_cache.to(**to), v_cache.to(**to), tables.to(torch.int32).to(**to)


def bench_decode(dtype, device, iters, with_triton):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch, ctx, mixed in DECODE_CASES:
        k, v, k_cache, v_cache, tables = _paged(batch, ctx, dtype, device, gen)
        if mixed:
            seq_lens = torch.randint(ctx // 16, ctx + 1, (batch,), generator=gen, dtype=torch.int32)
            seq_lens[0] = ctx
        else:
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
        mask = (torch.arange(ctx) < seq_lens[:, None].long())[:, None, None, :].to(device) if mixed else None
        seq_lens = seq_lens.to(device)
        query = torch.randn(batch, HQ, HEAD_DIM, generator=gen).to(dtype).to(device)
        scale = HEAD_DIM**-0.5
        q4 = query.view(batch, HKV, HQ // HKV, HEAD_DIM)

        def sdpa():
            return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale)

        def ref():
            return paged_attention_decode_ref(query, k_cache, v_cache, tables, seq_lens, scale, max_seq_len=ctx)

        expected = sdpa().reshape(batch, HQ, HEAD_DIM)
        torch.testing.assert_close(ref(), expected, atol=2e-2, rtol=2e-2)
        label = f"decode B={batch} ctx={'mixed <=' if mixed else ''}{ctx}"
        row = {"case": label, "sdpa": _time_ms(sdpa, device, iters), "torch": _time_ms(ref, device, iters)}
        if cpu_decode_supported(query, k_cache):

            def cpp():
                return paged_attention_decode_cpu(query, k_cache, v_cache, tables, seq_lens, scale)

            torch.testing.assert_close(cpp(), expected, atol=2e-2, rtol=2e-2)
            row["cpp"] = _time_ms(cpp, device, iters)
        if with_triton:
            from vlserve.kernels.triton_attention import paged_attention_decode_triton

            def tri():
                return paged_attention_decode_triton(query, k_cache, v_cache, tables, seq_lens, scale, max_seq_len=ctx)

            torch.testing.assert_close(tri(), expected, atol=2e-2, rtol=2e-2)
            row["triton"] = _time_ms(tri, device, iters)
        rows.append(row)
    return rows


def bench_prefill(dtype, device, iters, with_triton):
    gen = torch.Generator().manual_seed(1)
    rows = []
    for num_seqs, prefix, q_len in PREFILL_CASES:
        seq_len = prefix + q_len
        k, v, k_cache, v_cache, tables = _paged(num_seqs, seq_len, dtype, device, gen)
        seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
        qsl = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32, device=device)
        query = torch.randn(num_seqs * q_len, HQ, HEAD_DIM, generator=gen).to(dtype).to(device)
        scale = HEAD_DIM**-0.5
        mask = None
        if prefix:
            k_pos = torch.arange(seq_len, device=device)
            mask = k_pos[None, :] <= k_pos[prefix:, None]  # [q_len, S] bottom-right causal

        def sdpa():
            q = query.view(num_seqs, q_len, HQ, HEAD_DIM).transpose(1, 2)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )

        def ref():
            return paged_prefill_attention_ref(query, k_cache, v_cache, tables, qsl, seq_lens, scale)

        expected = sdpa().transpose(1, 2).reshape(-1, HQ, HEAD_DIM)
        torch.testing.assert_close(ref(), expected, atol=2e-2, rtol=2e-2)
        label = f"prefill {num_seqs}x(prefix {prefix} + {q_len} new)"
        row = {"case": label, "sdpa": _time_ms(sdpa, device, iters), "torch": _time_ms(ref, device, iters)}
        if with_triton:
            from vlserve.kernels.triton_prefill import paged_prefill_attention_triton

            def tri():
                return paged_prefill_attention_triton(
                    query, k_cache, v_cache, tables, qsl, seq_lens, scale, max_query_len=q_len
                )

            torch.testing.assert_close(tri(), expected, atol=2e-2, rtol=2e-2)
            row["triton"] = _time_ms(tri, device, iters)
        rows.append(row)
    return rows


def _print(rows, title, with_triton):
    print(f"\n{title}")
    head = f"| {'case':<34} | {'SDPA contiguous ms':>18} | {'torch paged ms':>14} | {'torch/SDPA':>10} |"
    with_cpp = any("cpp" in r for r in rows)
    if with_cpp:
        head += f" {'C++ ms':>8} | {'C++/SDPA':>8} |"
    if with_triton:
        head += f" {'triton ms':>9} | {'triton/SDPA':>11} |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        line = f"| {r['case']:<34} | {r['sdpa']:>18.2f} | {r['torch']:>14.2f} | {r['torch'] / r['sdpa']:>9.2f}x |"
        if with_cpp:
            line += f" {r['cpp']:>8.3f} | {r['cpp'] / r['sdpa']:>7.2f}x |"
        if with_triton:
            line += f" {r['triton']:>9.3f} | {r['triton'] / r['sdpa']:>10.2f}x |"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, dtype {args.dtype}, "
        f"Hq={HQ} Hkv={HKV} D={HEAD_DIM} BS={BLOCK_SIZE}; best of {args.iters} after warm-up"
    )
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    with torch.inference_mode():
        for device in devices:
            with_triton = device.type == "cuda"
            name = torch.cuda.get_device_name(device) if with_triton else "CPU"
            _print(bench_decode(dtype, device, args.iters, with_triton), f"[{name}] decode", with_triton)
            _print(bench_prefill(dtype, device, args.iters, with_triton), f"[{name}] prefill", with_triton)
            if with_triton:
                print(
                    f"\nCUDA times: per call inside a graph of {GRAPH_CALLS} calls; timed call by call (no "
                    f"capture): {', '.join(sorted(set(EAGER_ON_CUDA))) or 'none'}"
                )


if __name__ == "__main__":
    main()
