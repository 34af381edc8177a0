"""The suite's rules for a CUDA run (tests/conftest.py): tests that start a tensor-parallel engine are recognised
(they skip on a one-GPU machine), others are not; the default compile level switch is covered in
tests/worker/test_compilation.py."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.abspath(__file__))


def _conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", os.path.join(ROOT, "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Item:
    def __init__(self, function, marker=None):
        self.function, self.marker = function, marker

    def get_closest_marker(self, name):
        return self.marker if name == "multi_gpu" else None


def test_tensor_parallel_engine_tests_are_recognised():
    from tests.engine import test_tensor_parallel_engine as tp
    from tests.lora import test_lora_tp

    rules = _conftest()
    assert rules._starts_tp_engine(_Item(tp.test_tp2_equals_tp1_and_hf_with_chunks_preemption_and_prefix_hits))
    assert rules._starts_tp_engine(_Item(test_lora_tp.test_tp2_mixed_adapters_equal_hf_peft))
    assert not rules._starts_tp_engine(_Item(test_tensor_parallel_engine_tests_are_recognised))
    assert rules._starts_tp_engine(_Item(test_tensor_parallel_engine_tests_are_recognised, marker=object()))
