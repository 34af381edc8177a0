"""LoRA through `LLM`: greedy outputs token-exact against HF + PEFT merged (`merge_and_unload`), one batch mixing
three adapters and base prompts with max_loras=2 (the scheduler rotates adapters), chunked prefill and prefix
caching on (one prompt under two adapters gives each adapter's own output); n-gram and EAGLE spec decode keep the outputs;
the errors of asking for LoRA on an engine without it."""

from __future__ import annotations

import pytest
import torch

from tests.lora.lora_helpers import ALL, hf_model, make_adapter
from tests.support.hf_generate import hf_greedy_ignoring_eos
from vlserve import LLM, SamplingParams
from vlserve.lora import LoRARequest

MAX_NEW = 8
SHARED = [5, 17, 42, 7, 99, 3, 64, 12, 8, 150, 33, 21, 77, 9, 40, 41, 6, 18, 27, 2]  # 20 tokens, 5 blocks of 4
OTHER = [11, 23, 35, 47, 59, 61, 73, 85, 97, 109, 121, 133]
NGRAMMY = [4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23, 42, 4, 8, 15]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A llama checkpoint and three adapters over it (different targets and ranks): (model_dir, {name: path})."""
    from vlserve.demo.checkpoints import build_text_checkpoint

    root = tmp_path_factory.mktemp("lora_engine")
    model_dir = build_text_checkpoint(str(root / "base"), "llama")
    adapters = {
        "a": make_adapter(model_dir, root / "a", ALL, r=8, alpha=16, seed=1)[0],
        "b": make_adapter(model_dir, root / "b", ["q_proj", "v_proj", "down_proj"], r=4, alpha=8, seed=2)[0],
        "c": make_adapter(model_dir, root / "c", ["k_proj", "o_proj", "gate_proj", "up_proj"], r=16, alpha=16, seed=3)[
            0
        ],
    }
    return model_dir, adapters


def hf_reference(model_dir: str, adapter_dir: str | None, prompt: list[int]) -> list[int]:
    """HF greedy (EOS ignored) of the base merged with the adapter (or the base alone)."""
    from peft import PeftModel

    model = hf_model(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    ids = torch.tensor([prompt])
    return hf_greedy_ignoring_eos(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, MAX_NEW)[
        0, len(prompt) :
    ].tolist()


def requests_of(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(adapters.items()))}


def test_mixed_batch_matches_hf_peft(setup):
    model_dir, adapters = setup
    loras = requests_of(adapters)
    # (prompt, adapter name or None): the shared prompt under a, b and the base; three adapters with max_loras=2
    batch = [
        (SHARED, "a"),
        (SHARED, "b"),
        (OTHER, "c"),
        (SHARED, None),
        (OTHER, "a"),
        (OTHER, None),
        (SHARED, "c"),
        (SHARED, "a"),
    ]
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        max_lora_rank=16,
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(
        [p for p, _ in batch], params, use_tqdm=False, lora_request=[loras[n] if n else None for p, n in batch]
    )
    got = [o.outputs[0].token_ids for o in outs]
    want = {
        (tuple(p), n): hf_reference(model_dir, adapters[n] if n else None, p)
        for p, n in set((tuple(p), n) for p, n in batch)
    }
    assert got == [want[(tuple(p), n)] for p, n in batch]
    assert len({tuple(want[(tuple(SHARED), n)]) for n in ("a", "b", "c", None)}) == 4  # each adapter its own
    llm.check_integrity()

    # the same prompt again: prefix-cache hits within each adapter, still its own output
    before = llm.get_metrics()["vlserve:prefix_cache_hits_total"]
    again = llm.generate([SHARED, SHARED], params, use_tqdm=False, lora_request=[loras["b"], None])
    assert [o.outputs[0].token_ids for o in again] == [want[(tuple(SHARED), "b")], want[(tuple(SHARED), None)]]
    assert llm.get_metrics()["vlserve:prefix_cache_hits_total"] > before
    # one adapter for the whole batch, and chat-free generate with a single LoRARequest
    one = llm.generate([OTHER], params, use_tqdm=False, lora_request=loras["c"])
    assert one[0].outputs[0].token_ids == want[(tuple(OTHER), "c")]
    llm.check_integrity()


def test_ngram_spec_decode_keeps_adapter_outputs(setup):
    model_dir, adapters = setup
    loras = requests_of(adapters)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    batch = [(NGRAMMY, "a"), (NGRAMMY, None), (NGRAMMY, "b"), (SHARED, "c")]
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        block_size=4,
        num_kv_blocks=128,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    )
    outs = llm.generate(
        [p for p, _ in batch], params, use_tqdm=False, lora_request=[loras[n] if n else None for _, n in batch]
    )
    for (p, n), out in zip(batch, outs):
        assert out.outputs[0].token_ids == hf_reference(model_dir, adapters[n] if n else None, p), n
    assert llm.get_metrics()["vlserve:spec_decode_num_draft_tokens_total"] > 0
    llm.check_integrity()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_drafts_from_the_base_keep_adapter_outputs(setup, method, tmp_path):
    """EAGLE heads are trained on the base: they draft for adapter requests too (from the adapter model's hidden
    states), and the adapter model verifies, so outputs stay equal to HF + PEFT; drafts are proposed."""
    from vlserve.spec_decode.eagle_heads import build_eagle_checkpoint

    model_dir, adapters = setup
    loras = requests_of(adapters)
    head = build_eagle_checkpoint(str(tmp_path / "head"), model_dir, method, "mimic" if method == "eagle" else "random")
    batch = [(NGRAMMY, "a"), (SHARED, None), (OTHER, "b")]
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        block_size=4,
        num_kv_blocks=128,
        speculative_config={"method": method, "model": head, "num_speculative_tokens": 2},
    )
    outs = llm.generate(
        [p for p, _ in batch],
        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
        lora_request=[loras[n] if n else None for _, n in batch],
    )
    for (p, n), out in zip(batch, outs):
        assert out.outputs[0].token_ids == hf_reference(model_dir, adapters[n] if n else None, p), n
    assert llm.get_metrics()["vlserve:spec_decode_num_draft_tokens_total"] > 0
    llm.check_integrity()


def test_lora_errors(setup, tmp_path):
    model_dir, adapters = setup
    loras = requests_of(adapters)
    plain = LLM(model_dir, dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([OTHER], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras["a"])
    with pytest.raises(ValueError, match="enable_lora"):
        plain.chat(
            [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras["a"]
        )
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(model_dir, lora_modules={"a": adapters["a"]})
    llm = LLM(
        model_dir, dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8, block_size=4, num_kv_blocks=64
    )
    with pytest.raises(ValueError, match="max_lora_rank"):  # adapter c has rank 16: refused at add, not mid-step
        llm.generate([OTHER], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras["c"])
    with pytest.raises(ValueError, match="missing"):
        llm.generate(
            [OTHER], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=LoRARequest("nope", 9, str(tmp_path))
        )
    with pytest.raises(ValueError, match="own id"):  # one id, two adapters
        llm.generate(
            [OTHER, OTHER],
            SamplingParams(max_tokens=2),
            use_tqdm=False,
            lora_request=[loras["a"], LoRARequest("b", loras["a"].lora_int_id, adapters["b"])],
        )
    out = llm.generate([OTHER], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras["a"])
    assert len(out[0].outputs[0].token_ids) == 2
    llm.check_integrity()


def test_async_scheduling_keeps_adapter_outputs(setup):
    """Async scheduling (step N+1 launched before N is folded back) with a batch mixing three adapters and the base
    over two slots: the synchronous engine's outputs, which equal HF + PEFT (test above)."""
    model_dir, adapters = setup
    loras = requests_of(adapters)
    batch = [(SHARED, "a"), (OTHER, "b"), (SHARED, None), (OTHER, "c"), (SHARED, "b"), (OTHER, "a")]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = {}
    for use_async in (False, True):
        llm = LLM(
            model_dir,
            dtype="float32",
            device="cpu",
            enable_lora=True,
            max_loras=2,
            max_cpu_loras=2,
            max_lora_rank=16,
            block_size=4,
            num_kv_blocks=128,
            max_num_batched_tokens=16,
            async_scheduling=use_async,
        )
        got = llm.generate(
            [p for p, _ in batch], params, use_tqdm=False, lora_request=[loras[n] if n else None for _, n in batch]
        )
        outs[use_async] = [o.outputs[0].token_ids for o in got]
        llm.check_integrity()
    assert outs[True] == outs[False]
    assert outs[True][0] == hf_reference(model_dir, adapters["a"], SHARED)
    assert llm.engine.executor.runner.token_feed.num_fed_tokens > 0


def test_async_scheduling_with_lora_refused_across_ranks(setup):
    from vlserve.config import EngineArgs

    with pytest.raises(ValueError, match="tensor or pipeline parallel"):
        EngineArgs(model=setup[0], enable_lora=True, async_scheduling=True, tensor_parallel_size=2)
