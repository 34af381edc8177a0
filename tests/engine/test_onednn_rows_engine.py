"""An engine whose projections split by rows (the packed kernel below $VLSERVE_CPU_ONEDNN_ROWS rows, torch's
matmul from there on: what bf16 layers do on AMX CPUs) still matches HF token for token."""
import pytest

from tests.engine.conftest import hf_greedy, varied_prompts
from vlserve import LLM, SamplingParams
from vlserve.kernels import cpu_linear as cl

pytestmark = pytest.mark.skipif(cl.cpu_linear_kernel() is None, reason="no AVX2 + FMA or AVX-512 here")


@pytest.mark.parametrize("level", [0, 1])  # eager, and compiled: the row test becomes a guard on the token count
def test_split_projections_match_hf(qwen2_dir, monkeypatch, tmp_path, level):
    from transformers import AutoConfig

    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "8")
    rows = []
    kernel = cl.cpu_linear_kernel()
    monkeypatch.setattr(cl, "cpu_linear_kernel", lambda: lambda *args: rows.append(args[7]) or kernel(*args))
    prompts = varied_prompts(AutoConfig.from_pretrained(qwen2_dir).vocab_size, lengths=(3, 17, 40))
    compiled = {"compilation_config": {"level": 1, "cache_dir": str(tmp_path / "inductor")}} if level else {}
    llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, enforce_eager=not level,
              **compiled)
    model = llm.engine.runner.model
    assert all(m.weight is not None for m in model.modules() if getattr(m, "packed_weight", None) is not None)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(qwen2_dir, prompts, 8)
    assert rows and max(rows) < 8  # decode steps (3 rows) through the kernel; the prefill chunks were not
    llm.check_integrity()
