"""Audio loading: formats, mono mixdown, resampling, the placeholder count, and every bad-input case."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.multimodal.audio_media import AUDIO_CODECS, encode_audio, tones
from vlserve.multimodal.audio import audio_tokens, input_audio_data_url, load_audio, resample


@pytest.mark.parametrize("name", sorted(AUDIO_CODECS))
def test_formats_decode_to_mono_at_16k(name):
    stereo = tones(1.0, 44100, channels=2, seed=1)
    clip = load_audio(encode_audio(stereo, 44100, name), 16000)
    assert clip.sample_rate == 16000 and clip.waveform.dtype == np.float32
    assert abs(len(clip.waveform) - 16000) < 1200  # lossy codecs add priming / padding samples
    reference = resample(stereo.mean(axis=0).astype(np.float64), 44100, 16000)
    if name in ("wav", "flac"):  # lossless: equal to mixing and resampling the source (up to 16-bit rounding)
        np.testing.assert_allclose(clip.waveform, reference, atol=2e-4)
    else:
        assert np.max(np.abs(clip.waveform)) > 0.1


def test_array_pairs_mix_channels_either_axis_and_resample():
    stereo = tones(0.5, 22050, channels=2, seed=2)
    a = load_audio((stereo, 22050), 16000).waveform
    b = load_audio((stereo.T.copy(), 22050), 16000).waveform
    np.testing.assert_array_equal(a, b)
    expected = resample(stereo.astype(np.float64).mean(axis=0), 22050, 16000)
    np.testing.assert_allclose(a, expected, rtol=1e-6, atol=1e-7)
    assert len(a) == 8000
    mono = tones(0.5, 16000, seed=3)[0]
    np.testing.assert_array_equal(load_audio((mono, 16000), 16000).waveform, mono)


def test_input_audio_part_becomes_a_data_url():
    wav = encode_audio(tones(0.3), 16000, "wav")
    url = input_audio_data_url({"data": base64.b64encode(wav).decode(), "format": "wav"})
    assert url.startswith("data:audio/wav;base64,")
    assert len(load_audio(url, 16000).waveform) == 4800
    with pytest.raises(ValueError, match="input_audio.format 'aiff' is not supported"):
        input_audio_data_url({"data": "AAAA", "format": "aiff"})
    with pytest.raises(ValueError, match="needs {'data'"):
        input_audio_data_url({"format": "wav"})


@pytest.mark.parametrize(
    "source, message",
    [
        (b"RIFF\x00\x00garbage that is not audio at all" * 4, "could not decode audio"),
        (b"", "empty audio bytes"),
        ("data:audio/wav;base64,", "empty audio data URL"),
        ("data:image/png;base64,AAAA", "where audio data is expected"),
        ((np.zeros(0, np.float32), 16000), "zero length"),
        ((np.zeros(16000, np.float32), 0), "positive integer rate"),
        ((np.full(100, np.nan, np.float32), 16000), "finite"),
        (np.zeros(100, np.float32), "no sample rate"),
        ((np.zeros(31 * 16000, np.float32), 16000), "over the 30 s limit"),
    ],
)
def test_bad_audio_is_a_value_error(source, message):
    with pytest.raises(ValueError, match=message):
        load_audio(source, 16000)


def test_too_long_encoded_audio_stops_decoding():
    wav = encode_audio(np.zeros((1, 8000 * 40), np.float32), 8000, "wav")
    with pytest.raises(ValueError, match="longer than the 30 s limit"):
        load_audio(wav, 16000)
    assert len(load_audio(wav, 16000, max_seconds=45).waveform) == 16000 * 40 // 1


def test_video_without_audio_stream_is_refused():
    from tests.multimodal.mm_media import encode_video, rand_video

    with pytest.raises(ValueError, match="no audio stream"):
        load_audio(encode_video(rand_video(2, 32, 32)), 16000)


@pytest.mark.hf_parity
def test_placeholder_count_matches_hf_processor(audio_dir):
    from transformers import AutoProcessor

    from vlserve.multimodal.processor import MultiModalProcessor

    hf = AutoProcessor.from_pretrained(audio_dir)
    ours = MultiModalProcessor(hf)
    text = "<|audio_bos|><|AUDIO|><|audio_eos|>"
    audio_id = hf.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    for seconds in (0.05, 0.5, 1.01, 7.3, 29.99, 30.0):
        wave = tones(seconds, seed=4)[0]
        expected = hf(text=[text], audio=[wave], sampling_rate=16000, return_tensors="pt")["input_ids"][0].tolist()
        prompt = hf.tokenizer(text)["input_ids"]
        ids, feats = ours.process(prompt, audios=[(wave, 16000)])
        assert ids == expected, seconds
        assert feats[0].length == expected.count(audio_id) == audio_tokens(int(feats[0].data["valid_frames"][0]))
