"""Compile every vlserve Triton kernel ahead of time for an sm_90 GPU; needs no GPU (run as a script).

Run in a process WITHOUT TRITON_INTERPRET, so `@triton.jit` builds real JIT functions. Exits non-zero
if any kernel fails to lower through TTIR -> TTGIR -> LLVM -> PTX -> cubin.
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vlserve.kernels import triton_attention as ta  # noqa: E402
from vlserve.kernels import triton_kv_write as tw  # noqa: E402
from vlserve.kernels import triton_rotary as tr  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, types: dict[str, str], consts: dict, default: str = "i32") -> None:
    # every runtime argument not listed in `types` is an int (strides, lengths)
    sig = {name: "constexpr" if name in consts else types.get(name, default) for name in fn.arg_names}
    triton.compile(ASTSource(fn, sig, consts), target=TARGET)
    print(f"ok {fn.__name__} {consts}", flush=True)


def main() -> None:
    p2 = triton.next_power_of_2
    for dt, group, head_dim, block_size, single in [("bf16", 7, 80, 32, False), ("fp16", 4, 128, 16, True)]:
        ptrs = {n: f"*{dt}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        ptrs.update(bt_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32", scale_log2="fp32",
                    part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32")
        _compile(ta._decode_kernel, ptrs, dict(
            BLOCK_SIZE=block_size, NUM_Q_HEADS=2 * group, GROUP=group, GROUP_P2=max(16, p2(group)),
            HEAD_DIM=head_dim, HEAD_DIM_P2=p2(head_dim), BLOCK_N=64, SINGLE_SPLIT=single, UPCAST=False))
        _compile(ta._prefill_kernel, ptrs, dict(
            BLOCK_SIZE=block_size, GROUP=group, GROUP_P2=p2(group), HEAD_DIM=head_dim, HEAD_DIM_P2=p2(head_dim),
            BLOCK_M=max(1, 64 // p2(group)), BLOCK_N=32, UPCAST=False))
    _compile(ta._decode_reduce_kernel, dict(part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32",
                                            out_ptr="*bf16"),
             dict(NUM_Q_HEADS=28, HEAD_DIM=80, HEAD_DIM_P2=128, SPLITS_P2=8))
    _compile(tw._write_kv_kernel, {n: "*bf16" for n in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
             | dict(slot_ptr="*i64"),
             dict(BLOCK_SIZE=16, NUM_KV_HEADS=4, HEADS_P2=4, HEAD_DIM=80, HEAD_DIM_P2=128))
    _compile(tr._rotary_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32"),
             dict(SEC0=16, SEC01=40, IS_MROPE=True, NUM_Q_HEADS=28, Q_HEADS_P2=32, NUM_KV_HEADS=4, KV_HEADS_P2=4,
                  HALF=64, HALF_P2=64))


if __name__ == "__main__":
    main()
