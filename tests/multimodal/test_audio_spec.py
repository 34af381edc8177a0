"""Speculative decoding with Qwen2-Audio targets: n-gram and EAGLE drafts give the same greedy tokens as no
drafting, with chunked prefill windows that stop inside the audio runs."""

from __future__ import annotations

import pytest

from tests.multimodal.audio_hf import chat_text
from tests.multimodal.audio_media import encode_audio, tones
from vlserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A one-layer decoder, so the EAGLE head copied from its last layer gets drafts accepted."""
    from tests.support.audio_checkpoints import build_qwen2_audio_checkpoint

    return build_qwen2_audio_checkpoint(str(tmp_path_factory.mktemp("audio_spec_target")), num_layers=1)


@pytest.fixture(scope="module")
def eagle_head(target, tmp_path_factory):
    from vlserve.spec_decode.eagle_heads import build_eagle_checkpoint

    return build_eagle_checkpoint(str(tmp_path_factory.mktemp("audio_eagle") / "head"), target, "eagle", "mimic")


@pytest.fixture(scope="module")
def plain_outputs(target):
    llm = LLM(target, dtype="float32", num_kv_blocks=128)
    prompts, audios = audio_requests(llm.get_tokenizer())
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), audios=audios, use_tqdm=False)]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def audio_requests(tok) -> tuple[list[str], list[list]]:
    """Three chat prompts: one 1 s clip, one 2 s 44.1 kHz stereo wav, two clips in one prompt."""
    prompts = [
        chat_text(tok, [("user", (1, "beep beep beep beep"))]),
        chat_text(tok, [("user", (1, "one two one"))]),
        chat_text(tok, [("user", (2, "Describe both."))]),
    ]
    one = (tones(1.0, seed=21)[0], 16000)
    stereo = encode_audio(tones(2.0, 44100, channels=2, seed=22), 44100, "wav")
    return prompts, [[one], [stereo], [stereo, one]]


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_spec_decode_with_audio_equals_plain(target, eagle_head, plain_outputs, method):
    spec = NGRAM if method == "ngram" else {"method": "eagle", "num_speculative_tokens": 3, "model": eagle_head}
    llm = LLM(target, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=32, speculative_config=spec)
    prompts, audios = audio_requests(llm.get_tokenizer())
    outs = llm.generate(prompts, greedy(), audios=audios, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    m = llm.get_metrics()
    assert m["vlserve:spec_decode_num_draft_tokens_total"] > 0
    if method == "eagle":  # the mimic head copies the target's last layer: some drafts are right
        assert m["vlserve:spec_decode_num_accepted_tokens_total"] > 0
    llm.check_integrity()
