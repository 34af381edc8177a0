"""Disaggregated prefill / decode (P2PConnector, two engines in this process) beyond images: a Qwen2-VL video and
Qwen2-Audio clips are encoded on the producer only, and the consumer, given no media, decodes with n-gram or EAGLE
drafting on its side; greedy tokens equal one plain engine's, token for token, and the consumer never runs a
tower."""

from __future__ import annotations

import pytest

from tests.multimodal.audio_hf import chat_text
from tests.multimodal.audio_media import tones
from tests.multimodal.mm_media import rand_video
from vlserve import LLM, SamplingParams
from vlserve.config import KVTransferConfig

GREEDY = dict(temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _llm(model_dir, role=None, **kw):
    cfg = None if role is None else KVTransferConfig("P2PConnector", role, {})
    return LLM(model_dir, dtype="float32", num_kv_blocks=96, block_size=4, seed=0, kv_transfer_config=cfg, **kw)


def _disaggregated(a, b, prompt, max_tokens, **media):
    """Prefill on A (one token, kept blocks), then decode on B from A's params alone: B's request has no media."""
    pre = a.generate(
        prompt,
        SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}, **GREEDY),
        use_tqdm=False,
        **media,
    )[0]
    params = pre.kv_transfer_params
    assert params["remote_mm_features"], "the producer's params describe its media items"
    out = b.generate(
        {"prompt_token_ids": [0]},
        SamplingParams(max_tokens=max_tokens, kv_transfer_params=params, **GREEDY),
        use_tqdm=False,
    )[0]
    assert list(out.prompt_token_ids) == list(pre.prompt_token_ids)
    return list(pre.outputs[0].token_ids), list(out.outputs[0].token_ids)


def _check_consumer(b, a):
    mb = b.get_metrics()
    assert mb["vlserve:encoder_runs_total"] == 0
    assert mb["vlserve:kv_p2p_failed_loads_total"] == 0 and mb["vlserve:kv_p2p_loaded_blocks_total"] > 0
    assert a.get_metrics()["vlserve:encoder_runs_total"] > 0
    a.check_integrity()
    b.check_integrity()


@pytest.mark.slow
def test_video_prefill_on_a_decode_on_b(qwen2_vl_dir, mooncake):
    clips = [rand_video(4, 56, 56, seed=s) for s in (1, 2)]
    text = "What happens in the clip? Answer at length."
    ref = _llm(qwen2_vl_dir)
    want = [
        list(
            ref.generate(text, SamplingParams(max_tokens=8, **GREEDY), videos=[c], use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        for c in clips
    ]
    del ref
    assert want[0] != want[1]  # the clip matters
    a, b = _llm(qwen2_vl_dir, "kv_producer"), _llm(qwen2_vl_dir, "kv_consumer", speculative_config=NGRAM)
    for clip, w in zip(clips, want):
        first, got = _disaggregated(a, b, text, 8, videos=[clip])
        assert first == w[:1] and got == w
    _check_consumer(b, a)


@pytest.fixture(scope="module")
def audio_target(tmp_path_factory):
    """A one-layer decoder, so an EAGLE head copied from its last layer gets drafts accepted."""
    from tests.support.audio_checkpoints import build_qwen2_audio_checkpoint

    return build_qwen2_audio_checkpoint(str(tmp_path_factory.mktemp("p2p_audio")), num_layers=1)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_audio_prefill_on_a_spec_decode_on_b(audio_target, tmp_path_factory, mooncake, method):
    from vlserve.spec_decode.eagle_heads import build_eagle_checkpoint

    ref = _llm(audio_target)
    tok = ref.get_tokenizer()
    prompts = [chat_text(tok, [("user", (1, "beep beep beep beep"))]), chat_text(tok, [("user", (2, "Both?"))])]
    clips = [[(tones(1.0, seed=31)[0], 16000)], [(tones(1.5, seed=32)[0], 16000), (tones(0.5, seed=33)[0], 16000)]]
    sp = SamplingParams(max_tokens=12, **GREEDY)
    want = [list(o.outputs[0].token_ids) for o in ref.generate(prompts, sp, audios=clips, use_tqdm=False)]
    del ref
    spec = (
        NGRAM
        if method == "ngram"
        else {
            "method": "eagle",
            "num_speculative_tokens": 3,
            "model": build_eagle_checkpoint(
                str(tmp_path_factory.mktemp("p2p_eagle") / "h"), audio_target, "eagle", "mimic"
            ),
        }
    )
    # an EAGLE producer runs the same head: its draft layer's prompt KV moves with the target's
    a = _llm(audio_target, "kv_producer", **({"speculative_config": spec} if method == "eagle" else {}))
    b = _llm(audio_target, "kv_consumer", speculative_config=spec)
    for prompt, clip, w in zip(prompts, clips, want):
        first, got = _disaggregated(a, b, prompt, 12, audios=[clip])
        assert first == w[:1] and got == w
    m = b.get_metrics()
    assert m["vlserve:spec_decode_num_draft_tokens_total"] > 0
    if method == "eagle":  # without the draft's prompt KV, this head gets none accepted (it copies the target layer)
        assert m["vlserve:spec_decode_num_accepted_tokens_total"] > 0
    _check_consumer(b, a)


@pytest.mark.slow
def test_eagle_consumer_of_a_producer_without_the_head(audio_target, tmp_path_factory, mooncake):
    """Only the target's layers move: same greedy tokens (the drafts are verified), nothing leaks."""
    from vlserve.spec_decode.eagle_heads import build_eagle_checkpoint

    head = build_eagle_checkpoint(str(tmp_path_factory.mktemp("p2p_eagle2") / "h"), audio_target, "eagle", "mimic")
    ref = _llm(audio_target)
    prompt = chat_text(ref.get_tokenizer(), [("user", (1, "Again?"))])
    clip = [(tones(1.0, seed=34)[0], 16000)]
    want = list(
        ref.generate(prompt, SamplingParams(max_tokens=10, **GREEDY), audios=[clip], use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    del ref
    a = _llm(audio_target, "kv_producer")
    b = _llm(
        audio_target, "kv_consumer", speculative_config={"method": "eagle", "num_speculative_tokens": 3, "model": head}
    )
    first, got = _disaggregated(a, b, prompt, 10, audios=[clip])
    assert got == want
    _check_consumer(b, a)
