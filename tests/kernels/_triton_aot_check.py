"""Compile every vlserve Triton kernel ahead of time for an sm_90 GPU; needs no GPU (run as a module from the
repository root: `python -m tests.kernels._triton_aot_check`).

Run in a process WITHOUT TRITON_INTERPRET, so `@triton.jit` builds real JIT functions. Exits non-zero
if any kernel fails to lower through TTIR -> TTGIR -> LLVM -> PTX -> cubin.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vlserve.kernels import triton_attention as ta  # noqa: E402
from vlserve.kernels import triton_kv_write as tw  # noqa: E402
from vlserve.kernels import triton_prefill as tp  # noqa: E402
from vlserve.kernels import triton_rotary as tr  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H100_SHARED_BYTES = 232448  # the most shared memory one block may use on sm_90


def _compile(fn, types: dict[str, str], consts: dict, default: str = "i32", **options) -> None:
    # every runtime argument not listed in `types` is an int (strides, lengths); options: num_warps, num_stages
    sig = {name: "constexpr" if name in consts else types.get(name, default) for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, consts), target=TARGET, options=options or None)
    shared = kernel.metadata.shared
    if shared > H100_SHARED_BYTES:
        sys.exit(f"{fn.__name__} {consts} {options} needs {shared} bytes of shared memory")
    print(f"ok {fn.__name__} {consts} {options} shared={shared}", flush=True)


def _compile_prefill(
    ptrs: dict, group: int, head_dim: int, block_size: int, tile, fp8: bool = False, sliding: bool = False
) -> None:
    p2 = triton.next_power_of_2
    _compile(
        tp._prefill_kernel,
        ptrs,
        dict(
            BLOCK_SIZE=block_size,
            GROUP=group,
            GROUP_P2=p2(group),
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=p2(head_dim),
            BLOCK_M=max(1, tile.rows // p2(group)),
            BLOCK_N=tile.block_n,
            UPCAST=False,
            FP8=fp8,
            SLIDING=sliding,
        ),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def main() -> None:
    p2 = triton.next_power_of_2
    for dt, group, head_dim, block_size, single in [("bf16", 7, 80, 32, False), ("fp16", 4, 128, 16, True)]:
        ptrs = {n: f"*{dt}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        ptrs.update(
            bt_ptr="*i32",
            seq_lens_ptr="*i32",
            qsl_ptr="*i32",
            scale_log2="fp32",
            k_scale="fp32",
            v_scale="fp32",
            part_acc_ptr="*fp32",
            part_m_ptr="*fp32",
            part_l_ptr="*fp32",
        )
        _compile(
            ta._decode_kernel,
            ptrs,
            dict(
                BLOCK_SIZE=block_size,
                NUM_Q_HEADS=2 * group,
                GROUP=group,
                GROUP_P2=max(16, p2(group)),
                HEAD_DIM=head_dim,
                HEAD_DIM_P2=p2(head_dim),
                BLOCK_N=64,
                SINGLE_SPLIT=single,
                UPCAST=False,
                FP8=False,
            ),
        )
        _compile_prefill(ptrs, group, head_dim, block_size, tp.SMALL_TILE)
    # FP8 KV caches (float8_e4m3fn: fp8e4nv) under bf16 queries: decode, an H100 prefill tile, the writer
    fp8 = {n: "*bf16" for n in ("q_ptr", "out_ptr")} | {n: "*fp8e4nv" for n in ("k_cache_ptr", "v_cache_ptr")}
    fp8.update(
        bt_ptr="*i32",
        seq_lens_ptr="*i32",
        qsl_ptr="*i32",
        scale_log2="fp32",
        k_scale="fp32",
        v_scale="fp32",
        part_acc_ptr="*fp32",
        part_m_ptr="*fp32",
        part_l_ptr="*fp32",
    )
    _compile(
        ta._decode_kernel,
        fp8,
        dict(
            BLOCK_SIZE=16,
            NUM_Q_HEADS=8,
            GROUP=4,
            GROUP_P2=16,
            HEAD_DIM=128,
            HEAD_DIM_P2=128,
            BLOCK_N=64,
            SINGLE_SPLIT=False,
            UPCAST=False,
            FP8=True,
        ),
    )
    _compile(
        tw._write_kv_kernel,
        {n: "*bf16" for n in ("key_ptr", "value_ptr")}
        | {n: "*fp8e4nv" for n in ("k_cache_ptr", "v_cache_ptr")}
        | dict(slot_ptr="*i64", k_scale="fp32", v_scale="fp32"),
        dict(BLOCK_SIZE=16, NUM_KV_HEADS=4, HEADS_P2=4, HEAD_DIM=80, HEAD_DIM_P2=128, FP8=True, ROUND_FP8=False),
    )
    # the tiles prefill_tile picks on an H100 (sm_90) for 16-bit inputs, by head dim
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    ptrs.update(bt_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32", scale_log2="fp32", k_scale="fp32", v_scale="fp32")
    for group, head_dim in [(4, 128), (7, 80), (1, 64), (2, 256)]:
        _compile_prefill(ptrs, group, head_dim, 16, tp.prefill_tile(head_dim, torch.bfloat16, torch.device("cuda", 0)))
    # sliding-window layers (Mistral, Gemma 3): the prefill's extra masked loop
    _compile_prefill(ptrs, 4, 128, 16, tp.prefill_tile(128, torch.bfloat16, torch.device("cuda", 0)), sliding=True)
    _compile_prefill(fp8, 4, 128, 16, tp.prefill_tile(128, torch.bfloat16, torch.device("cuda", 0)), fp8=True)
    _compile(
        ta._decode_reduce_kernel,
        dict(part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", out_ptr="*bf16"),
        dict(NUM_Q_HEADS=28, HEAD_DIM=80, HEAD_DIM_P2=128, SPLITS_P2=8),
    )
    _compile(
        tw._write_kv_kernel,
        {n: "*bf16" for n in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
        | dict(slot_ptr="*i64", k_scale="fp32", v_scale="fp32"),
        dict(BLOCK_SIZE=16, NUM_KV_HEADS=4, HEADS_P2=4, HEAD_DIM=80, HEAD_DIM_P2=128, FP8=False, ROUND_FP8=False),
    )
    _compile(
        tr._rotary_kernel,
        dict(q_ptr="*bf16", k_ptr="*bf16", pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32"),
        dict(
            SEC0=16,
            SEC01=40,
            IS_MROPE=True,
            NUM_Q_HEADS=28,
            Q_HEADS_P2=32,
            NUM_KV_HEADS=4,
            KV_HEADS_P2=4,
            HALF=64,
            HALF_P2=64,
        ),
    )


if __name__ == "__main__":
    main()
