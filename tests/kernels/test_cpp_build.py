"""Every C++ CPU kernel builds on a machine that can build them: a build that breaks fails here, where the kernels'
own tests would only skip (their modules skip when the loader returns None and the torch paths take over)."""

from __future__ import annotations

import pytest

from vlserve.kernels import cpp_build
from vlserve.kernels.cpu_decode import cpu_decode_kernel
from vlserve.kernels.cpu_linear import build_cpu_linear, isas_here
from vlserve.kernels.grammar_mask import grammar_mask_kernel
from vlserve.kernels.lora_cpu import lora_cpu_kernel
from vlserve.kernels.quant_linear_cpu import build_quant_linear
from vlserve.kernels.quick_gelu_cpu import quick_gelu_cpu_kernel
from vlserve.kernels.rms_norm_cpu import rms_norm_cpu_kernel
from vlserve.kernels.rotary_cpu import rotary_cpu_kernel
from vlserve.kernels.silu_mul_cpu import silu_mul_cpu_kernel
from vlserve.kernels.varlen_attention_cpu import varlen_attention_cpu_kernel


def _compiler() -> str | None:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:
        return None


@pytest.mark.skipif(not isas_here(), reason="no AVX2 + FMA or AVX-512 here: the kernels are never built")
@pytest.mark.skipif(_compiler() is None, reason="no C++ compiler for inductor here")
def test_every_cpu_kernel_builds_here():
    loaders = {
        "cpu_decode": cpu_decode_kernel,
        "grammar_mask": grammar_mask_kernel,
        "lora_cpu": lora_cpu_kernel,
        "quick_gelu_cpu": quick_gelu_cpu_kernel,
        "rms_norm_cpu": rms_norm_cpu_kernel,
        "rotary_cpu": rotary_cpu_kernel,
        "silu_mul_cpu": silu_mul_cpu_kernel,
        "varlen_attention_cpu": varlen_attention_cpu_kernel,
    }
    for isa in isas_here():  # each path this CPU runs ($VLSERVE_CPU_ISA=avx2 picks the second on AVX-512)
        loaders[f"cpu_linear[{isa}]"] = lambda isa=isa: build_cpu_linear(isa)
        loaders[f"quant_linear[{isa}]"] = lambda isa=isa: build_quant_linear(isa)
    assert [name for name, load in loaders.items() if load() is None] == []
    outcomes = cpp_build.build_outcomes()
    # every entry source went through load_cpu_kernel above (a new kernel needs its loader in this list), and built
    assert sorted(set(cpp_build.entry_sources()) - set(outcomes)) == []
    assert [source for source, built in outcomes.items() if not built] == []


def test_a_source_that_does_not_build_is_recorded_and_left_to_torch(tmp_path, monkeypatch):
    (tmp_path / "broken.cpp").write_text('extern "C" void kernel(int64_t n) { this is not C++; }\n')
    monkeypatch.setattr(cpp_build, "CSRC", tmp_path)
    monkeypatch.setattr(cpp_build, "_OUTCOMES", {})
    declaration = '#include <cstdint>\nextern "C" void kernel(int64_t n);'
    assert cpp_build.load_cpu_kernel("broken.cpp", declaration, ("int64_t",)) is None
    assert cpp_build.build_outcomes() == {"broken.cpp": False}
    assert cpp_build.entry_sources() == ["broken.cpp"]
