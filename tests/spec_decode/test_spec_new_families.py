"""N-gram and EAGLE speculation over the newer VLM families (InternVL3, Mistral 3, Qwen3-VL-MoE, Gemma 3): greedy
output with drafts equals plain decoding on image prompts, through chunked prefill, and EAGLE drafts get accepted.

Each target has one decoder layer with a zero attention output (a draft that copies that layer predicts the target
exactly on text rows, so acceptance is not luck); Qwen3-VL-MoE gets two layers, the last dense, as the draft copies
a dense MLP (its drafts are checked for exactness, not acceptance). Gemma 3's layer (one sliding-window layer here)
cannot be copied into the Llama-style draft layer either, so its drafts too are checked for exactness only."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.multimodal.mm_media import rand_image
from vlserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["red red red square square square red red red square", "one two one two one two", "Describe."]


def _build(family: str, out: str) -> str:
    if family == "internvl":
        from tests.support.internvl_checkpoints import build_internvl_checkpoint

        return build_internvl_checkpoint(out, num_layers=1)
    if family == "mistral3":
        from tests.support.mistral3_checkpoints import build_mistral3_checkpoint

        return build_mistral3_checkpoint(out, num_layers=1)
    if family == "gemma3":
        from tests.support.gemma3_checkpoints import build_gemma3_vlm_checkpoint

        return build_gemma3_vlm_checkpoint(out, layer_types=("sliding_attention",))
    from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint

    return build_qwen3_vl_checkpoint(
        out,
        num_layers=2,
        deepstack_visual_indexes=(0,),
        moe={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "mlp_only_layers": [1]},
    )


@pytest.fixture(scope="module", params=["internvl", "mistral3", "qwen3_vl_moe", "gemma3"])
def target(request, tmp_path_factory):
    from tests.support.eagle_checkpoints import zero_attention_output

    path = _build(request.param, str(tmp_path_factory.mktemp(request.param) / "t"))
    zero_attention_output(path)
    return path


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _outputs(llm) -> list[list[int]]:
    imgs = [[Image.fromarray(rand_image(64, 64 + 32 * s, seed=s))] for s in range(3)]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy(), images=imgs, use_tqdm=False)]


KW = {"dtype": "float32", "num_kv_blocks": 128, "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def base(target) -> list[list[int]]:
    return _outputs(LLM(target, **KW))


def test_ngram_keeps_greedy_output(target, base):
    llm = LLM(target, speculative_config=NGRAM, **KW)
    assert _outputs(llm) == base  # n-gram drafts depend on what random weights happen to repeat: not counted
    llm.check_integrity()


def test_eagle_keeps_greedy_output(target, base, tmp_path):
    from vlserve.spec_decode.eagle_heads import build_eagle_checkpoint

    head = build_eagle_checkpoint(str(tmp_path / "head"), target, "eagle", "mimic")
    llm = LLM(target, speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 3}, **KW)
    assert _outputs(llm) == base
    m = llm.get_metrics()
    assert m["vlserve:spec_decode_num_draft_tokens_total"] > 0
    # The MoE target's first layer is not the one the draft copies; a Gemma 3 block (scaled (1 + w) norms, its
    # attention and MLP outputs normed before the residual adds, GeGLU) is no Llama layer: no exact mimic for either.
    if "moe" not in target and "gemma3" not in target:
        assert m["vlserve:spec_decode_num_accepted_tokens_total"] > 0
    llm.check_integrity()
