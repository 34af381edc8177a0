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
    llm = LLM(
        qwen2_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, enforce_eager=not level, **compiled
    )
    model = llm.engine.runner.model
    assert all(m.weight is not None for m in model.modules() if getattr(m, "packed_weight", None) is not None)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(qwen2_dir, prompts, 8)
    assert rows and max(rows) < 8  # decode steps (3 rows) through the kernel; the prefill chunks were not
    llm.check_integrity()


@pytest.mark.skipif(
    not __import__("vlserve.kernels.onednn_linear", fromlist=["x"]).onednn_prepacks(__import__("torch").bfloat16),
    reason="bf16 prepacking for oneDNN needs AMX",
)
def test_bf16_prepacked_matrices_run_eager_and_compiled_alike(qwen2_dir, monkeypatch, tmp_path):
    """On AMX a bf16 engine's split layers hold oneDNN's prepacked matrix (not the plain one); the compiled forward
    (freezing on) takes it through the opaque op. In bf16 inductor's fused elementwise ops round once where eager
    rounds per op, so the two agree on each prompt's first token (the prefill) but may part later."""
    from transformers import AutoConfig

    monkeypatch.delenv(cl.ONEDNN_ROWS_ENV, raising=False)
    prompts = varied_prompts(AutoConfig.from_pretrained(qwen2_dir).vocab_size, lengths=(3, 17, 40))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for level in (0, 1):
        compiled = {"compilation_config": {"level": 1, "cache_dir": str(tmp_path / "inductor")}} if level else {}
        llm = LLM(
            qwen2_dir,
            dtype="bfloat16",
            num_kv_blocks=64,
            max_num_batched_tokens=32,
            enforce_eager=not level,
            **compiled,
        )
        split = [m for m in llm.engine.runner.model.modules() if getattr(m, "onednn_weight", None) is not None]
        assert split and all(m.weight is None and m.packed_weight is not None for m in split)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.check_integrity()
    assert [t[0] for t in tokens[0]] == [t[0] for t in tokens[1]]
    assert all(len(t) == 8 for run in tokens for t in run)
