"""The engine end to end on the Triton kernels (compiled on CUDA, interpreted on CPU): greedy parity with HF."""

import pytest
import torch

from tests.engine.conftest import hf_greedy
from vlserve import LLM, SamplingParams


@pytest.mark.slow
def test_engine_greedy_parity_on_triton_backend(tmp_path, monkeypatch, device, triton_dispatch):
    from vlserve.demo.checkpoints import build_text_checkpoint

    model = build_text_checkpoint(str(tmp_path / "m"), arch="qwen2", hidden_size=64, num_layers=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 600, (n,), generator=g).tolist() for n in (3, 20)]
    expected = hf_greedy(model, prompts, 4)
    monkeypatch.setenv("VLSERVE_ATTENTION_BACKEND", "triton")
    llm = LLM(model, dtype="float32", num_kv_blocks=8, max_num_batched_tokens=16, block_size=16, device=device.type)
    import vlserve.kernels as kernels

    assert kernels.get_attention_backend(device) == "triton"
    assert llm.engine.runner.device.type == device.type
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.check_integrity()
