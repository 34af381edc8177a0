"""Qwen2-Audio end to end: our encoder and greedy decoding against HF (both checkpoint layouts), through
LLM.generate(audios=...), multi_modal_data dicts and LLM.chat; chunked prefill, preemption, the encoder cache."""

from __future__ import annotations

import base64
import json
import os
import shutil

import numpy as np
import pytest
import torch

from tests.multimodal.audio_hf import MAX_NEW, HFAudioOracle, chat_text
from tests.multimodal.audio_media import encode_audio, tones
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def oracle(audio_dir):
    return HFAudioOracle(audio_dir)


@pytest.fixture(scope="module")
def llm(audio_dir):
    return LLM(audio_dir, dtype="float32", num_kv_blocks=512)


def clips():
    """Named clips: lengths from 0.5 to 30 s, 16 kHz mono arrays and 44.1 kHz stereo arrays / encoded files."""
    return {
        "0.5s": (tones(0.5, seed=1)[0], 16000),
        "3s-44k-stereo": (tones(3.0, 44100, channels=2, seed=2), 44100),
        "30s": (tones(30.0, seed=3)[0], 16000),
        "flac-44k-stereo": encode_audio(tones(2.0, 44100, channels=2, seed=4), 44100, "flac"),
    }


def test_encoder_embeddings_match_hf(audio_dir, oracle, llm):
    """The rows HF writes over the <|AUDIO|> tokens equal our encoder + projector output (two clips, one batch)."""
    c = clips()
    pair = [c["0.5s"], c["3s-44k-stereo"]]
    text = chat_text(oracle.processor.tokenizer, [("user", (2, "Compare."))])
    inputs = oracle.inputs(text, pair)
    captured = {}

    def grab(_module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    inner = getattr(oracle.model, "model", None)  # 5.x nests the parts under .model; 4.57 does not
    decoder = inner.language_model if inner is not None else oracle.model.language_model
    handle = decoder.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            oracle.model(**inputs)
    finally:
        handle.remove()
    audio_id = oracle.processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    hf_rows = captured["embeds"][0][inputs["input_ids"][0] == audio_id]  # [N, H]

    proc = llm.engine_loop.core.loaded.mm_processor
    ids, feats = proc.process(oracle.processor.tokenizer(text)["input_ids"], audios=pair)
    assert ids == inputs["input_ids"][0].tolist()
    from vlserve.worker.encoder_runs import concat_mm_data

    model = llm.engine_loop.core.loaded.model
    ours = model.embed_multimodal("audio", concat_mm_data([f.data for f in feats]))
    assert ours.shape == hf_rows.shape and ours.shape[0] == 12 + 75  # 25 tokens a second
    torch.testing.assert_close(ours, hf_rows, rtol=1e-4, atol=1e-5)


def test_generate_audios_and_dicts_match_hf(oracle, llm):
    tok = llm.get_tokenizer()
    c = clips()
    cases = [
        ("0.5s", chat_text(tok, [("user", (1, "What is this?"))]), [c["0.5s"]]),
        ("44k stereo", chat_text(tok, [("user", (1, "What is this?"))]), [c["3s-44k-stereo"]]),
        ("30s", chat_text(tok, [("user", (1, "Describe the audio."))]), [c["30s"]]),
        ("two clips", chat_text(tok, [("user", (2, "Which is louder?"))]), [c["0.5s"], c["flac-44k-stereo"]]),
        (
            "follow-up",
            chat_text(tok, [("user", (1, "What is it?")), ("assistant", "A beep."), ("user", (0, "And how long?"))]),
            [c["3s-44k-stereo"]],
        ),
    ]
    expected = [oracle.greedy(text, cl) for _, text, cl in cases]
    via_audios = llm.generate([t for _, t, _ in cases], greedy(), audios=[cl for _, _, cl in cases], use_tqdm=False)
    via_dicts = llm.generate(
        [{"prompt": t, "multi_modal_data": {"audio": cl}} for _, t, cl in cases], greedy(), use_tqdm=False
    )
    for (name, _, _), exp, a, d in zip(cases, expected, via_audios, via_dicts):
        assert a.outputs[0].token_ids == exp, name
        assert d.outputs[0].token_ids == exp, name
    llm.check_integrity()


def test_chat_with_input_audio_and_audio_url_parts(oracle, llm, tmp_path):
    c = clips()
    wav = encode_audio(tones(1.5, 22050, channels=2, seed=5), 22050, "wav")
    path = tmp_path / "clip.mp3"
    path.write_bytes(encode_audio(tones(1.0, 16000, seed=6), 16000, "mp3"))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                {"type": "audio_url", "audio_url": {"url": f"file://{path}"}},
                {"type": "text", "text": "Two sounds?"},
            ],
        },
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": [{"type": "text", "text": "Are you sure?"}]},
    ]
    out = llm.chat(messages, greedy(), use_tqdm=False)[0]
    text = chat_text(
        llm.get_tokenizer(), [("user", (2, "Two sounds?")), ("assistant", "Yes."), ("user", (0, "Are you sure?"))]
    )
    assert out.outputs[0].token_ids == oracle.greedy(text, [wav, str(path)])
    del c


@pytest.mark.parametrize(
    "engine_kw",
    [
        {"max_num_batched_tokens": 48},  # chunked prefill: windows stop inside the audio runs
        {"num_kv_blocks": 16, "block_size": 16, "max_num_batched_tokens": 512},  # forced preemption
    ],
    ids=["chunked", "preempt"],
)
def test_chunked_prefill_and_preemption_match_hf(audio_dir, oracle, engine_kw):
    llm = LLM(audio_dir, dtype="float32", **{"num_kv_blocks": 256, **engine_kw})
    tok = llm.get_tokenizer()
    c = clips()
    cases = [
        (chat_text(tok, [("user", (1, f"Question {i}?"))]), [clip])
        for i, clip in enumerate([c["3s-44k-stereo"], c["0.5s"], c["flac-44k-stereo"], (tones(4.0, seed=7)[0], 16000)])
    ]
    n = 24 if "num_kv_blocks" in engine_kw else MAX_NEW
    outs = llm.generate([t for t, _ in cases], greedy(n), audios=[cl for _, cl in cases], use_tqdm=False)
    for (text, cl), out in zip(cases, outs):
        assert out.outputs[0].token_ids == oracle.greedy(text, cl, n)
    if "num_kv_blocks" in engine_kw:
        assert llm.get_metrics()["vlserve:num_preemptions_total"] > 0
    llm.check_integrity()


def test_one_clip_in_eight_requests_runs_the_encoder_once(audio_dir):
    llm = LLM(audio_dir, dtype="float32", num_kv_blocks=256)
    tok = llm.get_tokenizer()
    clip = encode_audio(tones(2.0, 44100, channels=2, seed=8), 44100, "wav")
    prompts = [chat_text(tok, [("user", (1, f"Question number {i}?"))]) for i in range(8)]
    outs = llm.generate(prompts, greedy(4), audios=[[clip]] * 8, use_tqdm=False)
    assert len({o.prompt_token_ids.count(tok.convert_tokens_to_ids("<|AUDIO|>")) for o in outs}) == 1
    m = llm.get_metrics()
    assert m["vlserve:encoder_runs_total"] == 1
    assert m['vlserve:encoder_runs_by_modality_total{modality="audio"}'] == 1
    assert m['vlserve:encoder_cache_misses_by_modality_total{modality="audio"}'] == 1
    assert m['vlserve:encoder_cache_hits_by_modality_total{modality="audio"}'] == 7
    assert m["vlserve:prefix_cache_hits_total"] > 0  # same clip, same prefix: blocks shared
    llm.check_integrity()


def test_prefix_cache_tells_clips_apart(audio_dir):
    """Same prompt text, different clip of the same length: no prefix hit over the audio run, outputs differ."""
    llm = LLM(audio_dir, dtype="float32", num_kv_blocks=256)
    text = chat_text(llm.get_tokenizer(), [("user", (1, "Same words."))])
    a = llm.generate([text], greedy(), audios=[[(tones(2.0, seed=9)[0], 16000)]], use_tqdm=False)[0]
    hits = llm.get_metrics()["vlserve:prefix_cache_hits_total"]
    b = llm.generate([text], greedy(), audios=[[(tones(2.0, seed=10)[0], 16000)]], use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids
    assert llm.get_metrics()["vlserve:encoder_runs_total"] == 2
    audio_start = a.prompt_token_ids.index(llm.get_tokenizer().convert_tokens_to_ids("<|AUDIO|>"))
    # prefix hits are counted in tokens: at most the whole blocks before the audio run
    assert llm.get_metrics()["vlserve:prefix_cache_hits_total"] - hits <= audio_start // 16 * 16
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_module_layout_checkpoint_loads_the_same(audio_dir, llm, tmp_path):
    """transformers 5.x module names (model.audio_tower.*, model.language_model.*, lm_head.weight) load too."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "module_layout"
    shutil.copytree(audio_dir, out)
    renames = (
        ("audio_tower.", "model.audio_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
    )
    tensors = load_file(os.path.join(audio_dir, "model.safetensors"))
    renamed = {}
    for name, t in tensors.items():
        new = next((new + name[len(old) :] for old, new in renames if name.startswith(old)), name)
        renamed[new] = t
    assert any(k.startswith("model.audio_tower.") for k in renamed) and "lm_head.weight" in renamed
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    clip = [(tones(1.0, seed=11)[0], 16000)]
    text = chat_text(llm.get_tokenizer(), [("user", (1, "Hi?"))])
    other = LLM(str(out), dtype="float32", num_kv_blocks=64)
    assert (
        other.generate([text], greedy(), audios=[clip], use_tqdm=False)[0].outputs[0].token_ids
        == llm.generate([text], greedy(), audios=[clip], use_tqdm=False)[0].outputs[0].token_ids
    )
    renamed["model.audio_tower.extra.weight"] = torch.zeros(1)
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weights.*extra"):
        LLM(str(out), dtype="float32", num_kv_blocks=64)
    assert json.load(open(out / "config.json"))["architectures"] == ["Qwen2AudioForConditionalGeneration"]


def test_bad_audio_leaves_nothing_behind(llm):
    text = chat_text(llm.get_tokenizer(), [("user", (1, "Hi?"))])
    bad = [
        b"not audio at all, just bytes" * 3,
        (np.zeros(0, np.float32), 16000),
        (np.zeros(31 * 16000, np.float32), 16000),
        (np.zeros(10, np.float32), 16000),
    ]
    for clip in bad:
        with pytest.raises(ValueError):
            llm.generate([text, text], greedy(), audios=[[(tones(1.0)[0], 16000)], [clip]], use_tqdm=False)
    with pytest.raises(ValueError, match="1 audio placeholder tokens .* but 2 audio clips"):
        llm.generate([text], greedy(), audios=[[(tones(1.0)[0], 16000)] * 2], use_tqdm=False)
    assert not llm.engine_loop.core.has_unfinished_requests()
    llm.check_integrity()
    assert llm.generate([text], greedy(), audios=[[(tones(1.0)[0], 16000)]], use_tqdm=False)[0].outputs[0].token_ids
