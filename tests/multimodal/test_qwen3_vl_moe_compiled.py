"""Qwen3-VL-MoE compiled (-O1) on CPU: the packed experts run as one opaque op (routing sizes the expert groups,
which a compiled graph cannot guard on), and the output equals HF token for token."""

import pytest

from tests.multimodal.test_qwen3_vl import Qwen3Oracle, _cases, _run
from tests.multimodal.test_qwen3_vl_moe import MOE
from vlserve import LLM

pytestmark = pytest.mark.slow


def test_compiled_moe_matches_hf(tmp_path_factory, tmp_path):
    from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint

    moe_dir = build_qwen3_vl_checkpoint(str(tmp_path_factory.mktemp("qwen3_vl_moe_compiled")), moe=MOE)
    oracle = Qwen3Oracle(moe_dir)
    cases = [c for c in _cases(oracle) if not c[3]][:2]  # two image cases
    llm = LLM(
        moe_dir,
        dtype="float32",
        num_kv_blocks=128,
        compilation_config={"level": 1, "cache_dir": str(tmp_path / "inductor")},
    )
    assert _run(llm, cases) == [oracle.greedy(text, imgs, vids) for _, text, imgs, vids in cases]
    llm.check_integrity()
