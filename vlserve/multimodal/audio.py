"""Audio input: decoding (PyAV), mono mixdown, resampling (scipy's resample_poly) and the per-clip Whisper feature
extraction + placeholder count of Qwen2-Audio.

Sources a clip may come as: `(np.ndarray, sample_rate)` (1-D, or 2-D with the shorter axis as channels), encoded
bytes / a path / a `data:audio/...;base64,` URL (wav, mp3, flac, ogg/opus, m4a, anything FFmpeg reads), or an
already loaded `LoadedAudio`. Every problem with untrusted input (corrupt or empty data, no audio stream, no
samples, non-finite samples, too long) is a ValueError naming it, so the API layer answers 400.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from math import gcd
from typing import Any

import numpy as np

from vlserve.multimodal.hashing import hash_mm_item
from vlserve.multimodal.media import _source_bytes_or_path
from vlserve.shorten import shorten

DEFAULT_MAX_AUDIO_SECONDS = 30.0  # Whisper's window: the feature extractor truncates anything longer
# OpenAI `input_audio.format` values accepted (the bytes are sniffed by FFmpeg either way).
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm")


@dataclass
class LoadedAudio:
    """A mono clip at the rate it was resampled to."""

    waveform: np.ndarray  # float32 [num_samples]
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.waveform) / self.sample_rate


def input_audio_data_url(part: Any) -> str:
    """An OpenAI `input_audio` payload `{"data": <base64>, "format": "wav"}` -> a data URL the loader decodes."""
    if not isinstance(part, dict) or not isinstance(part.get("data"), str):
        raise ValueError("content part 'input_audio' needs {'data': <base64 string>, 'format': ...}")
    fmt = part.get("format", "wav")
    if not isinstance(fmt, str) or fmt.lower() not in INPUT_AUDIO_FORMATS:
        raise ValueError(
            f"input_audio.format {shorten(fmt)} is not supported; use one of {', '.join(INPUT_AUDIO_FORMATS)}"
        )
    return f"data:audio/{fmt.lower()};base64,{part['data']}"


def _to_mono(samples: np.ndarray) -> np.ndarray:
    """1-D, or 2-D with the shorter axis as channels -> float64 [N] (mean of the channels)."""
    if samples.ndim == 1:
        return samples.astype(np.float64)
    if samples.ndim != 2:
        raise ValueError(f"an audio array must be 1-D (mono) or 2-D (channels x samples), got shape {samples.shape}")
    channel_axis = 0 if samples.shape[0] <= samples.shape[1] else 1
    return samples.astype(np.float64).mean(axis=channel_axis)


def resample(waveform: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """Polyphase resampling (scipy.signal.resample_poly) of a mono float waveform -> float32."""
    if source_rate == target_rate:
        return waveform.astype(np.float32)
    from scipy.signal import resample_poly

    g = gcd(int(source_rate), int(target_rate))
    return resample_poly(waveform, int(target_rate) // g, int(source_rate) // g).astype(np.float32)


def _decode(src: bytes | str, max_seconds: float) -> tuple[np.ndarray, int]:
    """Encoded audio -> (float [channels, N], sample rate); stops with a ValueError once past max_seconds."""
    import av

    chunks: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(src) if isinstance(src, bytes) else src) as container:
            if not container.streams.audio:
                raise ValueError("no audio stream in the input")
            stream = container.streams.audio[0]
            rate = int(stream.codec_context.sample_rate or stream.rate or 0)
            if rate <= 0:
                raise ValueError("the audio stream has no sample rate")
            limit = int(max_seconds * rate) + rate  # a second of slack: the exact check follows
            resampler = av.AudioResampler(format="fltp")  # planar float, same layout and rate
            total = 0
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    arr = out.to_ndarray()  # [channels, n]
                    chunks.append(arr)
                    total += arr.shape[1]
                if total > limit:
                    raise ValueError(f"audio is longer than the {max_seconds:g} s limit")
    except (av.FFmpegError, OSError, EOFError) as e:  # checked first: PyAV errors also subclass ValueError
        raise ValueError(f"could not decode audio: {shorten(str(e), 200)}") from None
    if not chunks:
        raise ValueError("audio has no decodable samples")
    return np.concatenate(chunks, axis=1), rate


def load_audio(x: Any, target_rate: int, max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS) -> LoadedAudio:
    """Any supported source -> mono float32 at `target_rate`, checked for length, emptiness and finite samples."""
    if isinstance(x, LoadedAudio):
        if x.sample_rate != target_rate:
            x = LoadedAudio(resample(x.waveform, x.sample_rate, target_rate), target_rate)
        samples, rate = x.waveform, x.sample_rate
    elif isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], np.ndarray):
        samples, rate = x
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise ValueError(f"an audio (array, sample_rate) pair needs a positive integer rate, got {shorten(rate)}")
        if not np.issubdtype(samples.dtype, np.number):
            raise ValueError(f"audio samples must be numbers, got dtype {samples.dtype}")
        samples = _to_mono(samples)
    elif isinstance(x, np.ndarray):
        raise ValueError("a bare audio array has no sample rate; pass (array, sample_rate)")
    else:
        samples, rate = _decode(_source_bytes_or_path(x, "audio"), max_seconds)
        samples = samples.mean(axis=0) if samples.shape[0] > 1 else samples[0]
    if samples.size == 0:
        raise ValueError("audio has no samples (zero length)")
    if len(samples) > max_seconds * rate:
        raise ValueError(f"audio is {len(samples) / rate:.1f} s long, over the {max_seconds:g} s limit")
    if not np.all(np.isfinite(samples)):
        raise ValueError("audio samples must be finite (found NaN or inf)")
    return LoadedAudio(resample(np.asarray(samples), int(rate), target_rate), target_rate)


def audio_tokens(valid_frames: int) -> int:
    """`<|AUDIO|>` tokens for a clip of `valid_frames` feature frames, as HF's Qwen2-Audio processor counts them:
    (((frames - 1) // 2 + 1) - 2) // 2 + 1 (stride-2 conv, then 2x pooling)."""
    return (((valid_frames - 1) // 2 + 1) - 2) // 2 + 1


class AudioItemProcessor:
    """One clip -> (mm_hash, processed data) through the checkpoint's WhisperFeatureExtractor.

    data = {"input_features": float [F, M] (time-major mel frames: the valid ones plus 2 of padding, which the
    encoder's conv stem reads, or the whole window), "feature_frames": int64 [1] (F),
    "valid_frames": int64 [1] (feature_attention_mask.sum())}.
    """

    def __init__(self, feature_extractor: Any, max_seconds: float | None = None):
        """`max_seconds` None: the feature extractor's window (30 s for Whisper's)."""
        self.feature_extractor = feature_extractor
        self.sample_rate = int(feature_extractor.sampling_rate)
        window = float(feature_extractor.n_samples) / self.sample_rate
        max_seconds = window if max_seconds is None else max_seconds
        if not 0 < max_seconds <= window:
            raise ValueError(
                f"max audio seconds must be in (0, {window:g}] (the feature extractor's window), got {max_seconds}"
            )
        self.max_seconds = float(max_seconds)

    def load_and_hash(self, audio: Any) -> tuple[LoadedAudio, str]:
        """Decode to mono at the extractor's rate and hash the waveform (+ rate)."""
        clip = load_audio(audio, self.sample_rate, self.max_seconds)
        return clip, hash_mm_item("audio", clip.waveform, {"sampling_rate": self.sample_rate})

    def features(self, clip: LoadedAudio) -> dict:
        """Run the feature extractor as HF's processor does (padded to the window, with its attention mask)."""
        import torch

        out = self.feature_extractor(
            clip.waveform,
            sampling_rate=self.sample_rate,
            return_attention_mask=True,
            padding="max_length",
            return_tensors="pt",
        )
        mel, mask = out["input_features"][0], out["attention_mask"][0]  # [M, W], [W]
        valid = int(mask.sum())
        if audio_tokens(valid) < 1:
            raise ValueError(f"audio of {clip.seconds * 1000:.1f} ms is too short to give any audio token")
        keep = min(valid + 2, mel.shape[1])
        return {
            "input_features": mel[:, :keep].transpose(0, 1).contiguous(),  # [F, M]
            "feature_frames": torch.tensor([keep], dtype=torch.long),
            "valid_frames": torch.tensor([valid], dtype=torch.long),
        }
