"""LoRA with decode CUDA graphs, device-independently: decode steps go through the graph runner's padding and the
manager's persistent slot buffer (`graph_slots`, what a captured graph reads), run eagerly as a replay would
(`CudaGraphRunner(use_graphs=False)`), under the captured step where every layer adds its delta. A batch mixing two
adapters and the base, finishing one by one (batches padded to buckets 1 / 2 / 4 / 8), equals the same engine
without graphs, and the padding rows read slot -1."""

from __future__ import annotations

import torch

from tests.lora.lora_helpers import ALL, make_adapter
from vlserve import LLM, SamplingParams
from vlserve.lora import LoRARequest
from vlserve.worker.cuda_graphs import CudaGraphRunner, DecodeBuffers

PROMPTS = [[5, 17, 42, 7, 99, 3], [64, 12, 8, 150, 33], [21, 77, 9, 4, 61, 88, 2], [13, 14, 15], [40, 41, 42]]
MAX_NEW = [12, 5, 9, 7, 3]  # finishing one by one: decode batches 5, 4, 3, 2, 1


def test_padded_decode_graph_steps_keep_adapter_outputs(checkpoint, tmp_path):
    model_dir, _ = checkpoint("qwen2")
    a1 = make_adapter(model_dir, tmp_path / "a1", ALL, r=4, seed=1)[0]
    a2 = make_adapter(model_dir, tmp_path / "a2", ["q_proj", "v_proj", "down_proj"], r=8, alpha=16, seed=2)[0]
    loras = [LoRARequest("a1", 1, a1), None, LoRARequest("a2", 2, a2), LoRARequest("a1", 1, a1), None]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_NEW]
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(model_dir, **kw).generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=loras
        )
    ]

    llm = LLM(model_dir, **kw)
    runner = llm.engine.runner
    manager = runner.lora_manager
    sizes = [1, 2, 4, 8]
    manager.enable_graph_slots(max(sizes))
    buffers = DecodeBuffers(max(sizes), 64, runner.block_size, False, runner.device)
    seen = []

    def forward(step):
        rows = step.metadata.num_seqs
        seen.append((sum(n > 1 for n in step.metadata.seq_lens_cpu), rows, manager.graph_slots[:rows].tolist()))
        return runner.forward.run(step, runner.kv_caches)

    runner.forward.graph_runner = CudaGraphRunner(forward, buffers, sizes, 1024, use_graphs=False, lora=manager)
    got = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=loras)
    ]
    assert got == expected
    assert {(5, 8), (3, 4), (1, 1)} <= {(b, bucket) for b, bucket, _ in seen}  # padded and exact buckets ran
    for b, bucket, slots in seen:
        assert slots[b:] == [-1] * (bucket - b)  # padding rows: the base model
    first = next(slots for b, _, slots in seen if b == 5)
    assert sorted(set(first[:5])) == [-1, 0, 1]  # two adapters and the base in one padded step
    assert got[0] != got[1] or PROMPTS[0] != PROMPTS[1]
    llm.check_integrity()


def test_a_captured_step_runs_every_layers_delta(checkpoint):
    """Under the captured step each LoRA layer launches its delta even with no adapter loaded (a graph captured
    then must still add the deltas of adapters loaded later); slot -1 rows stay the base output bit for bit."""
    from tests.lora.lora_helpers import our_model
    from vlserve.lora import LoRAModelManager
    from vlserve.lora.layers import LoRALayerMixin, current_lora_step

    model_dir, cfg = checkpoint("qwen2")
    manager = LoRAModelManager(our_model(model_dir, cfg), max_loras=2, max_lora_rank=4)
    manager.enable_graph_slots(4)
    layer = next(m for m in manager.targets.values() if isinstance(m, LoRALayerMixin))
    x = torch.randn(4, layer.in_features)
    base = layer.matmul(x, layer.bias)
    with manager.graph_step(4):
        assert current_lora_step().captured and layer.lora_active(current_lora_step())
        out = layer(x)
    assert torch.equal(out, base)  # slots all -1, no weights: exactly the base
