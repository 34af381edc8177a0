"""A VL engine whose towers stay unpacked and whose decoder splits by rows (what bf16 does on AMX CPUs, forced
here by $VLSERVE_CPU_ONEDNN_ROWS) still matches HF token for token."""

import pytest

from tests.multimodal.test_mm_engine_parity import HFOracle, _case_prompts, _run_llm
from vlserve import LLM
from vlserve.kernels import cpu_linear as cl

pytestmark = pytest.mark.skipif(cl.cpu_linear_kernel() is None, reason="no AVX2 + FMA or AVX-512 here")


def test_unpacked_tower_and_split_decoder_match_hf(qwen2_vl_dir, monkeypatch):
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "8")
    llm = LLM(qwen2_vl_dir, dtype="float32", num_kv_blocks=256)
    model = llm.engine.runner.model
    tower = [m for part in model.encoder_parts() for m in part.modules() if hasattr(m, "packed_weight")]
    assert tower and all(m.packed_weight is None and m.weight is not None for m in tower)
    decoder = [m for m in model.language_model.modules() if getattr(m, "packed_weight", None) is not None]
    assert decoder and all(m.onednn_rows == 8 and m.weight is not None for m in decoder)
    cases = _case_prompts(llm.get_tokenizer())[:3]
    hf = HFOracle(qwen2_vl_dir)
    assert _run_llm(llm, cases) == [hf.greedy(text, imgs, vids) for _, text, imgs, vids in cases]
    llm.check_integrity()
