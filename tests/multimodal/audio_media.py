"""Audio generators for the audio tests: random-ish tones and PyAV-encoded files."""

from __future__ import annotations

import io

import numpy as np

# test name -> (container format, codec, sample rate the codec is given)
AUDIO_CODECS = {
    "wav": ("wav", "pcm_s16le", None),
    "mp3": ("mp3", "libmp3lame", None),
    "flac": ("flac", "flac", None),
    "ogg": ("ogg", "libopus", 48000),
    "m4a": ("ipod", "aac", None),
}


def tones(seconds: float, sample_rate: int = 16000, channels: int = 1, seed: int = 0) -> np.ndarray:
    """float32 [channels, N]: a few random sine tones plus a little noise, amplitude below 0.5."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * sample_rate))) / sample_rate
    out = np.zeros((channels, t.size), dtype=np.float64)
    for c in range(channels):
        for freq in rng.uniform(200, 2000, size=3):
            out[c] += 0.1 * np.sin(2 * np.pi * freq * t + rng.uniform(0, np.pi))
        out[c] += 0.02 * rng.standard_normal(t.size)
    return out.astype(np.float32)


def encode_audio(samples: np.ndarray, sample_rate: int, name: str = "wav") -> bytes:
    """Encode float [channels, N] samples into an in-memory file of AUDIO_CODECS[name] with PyAV."""
    import av

    fmt, codec, forced_rate = AUDIO_CODECS[name]
    if forced_rate is not None and forced_rate != sample_rate:
        from vlserve.multimodal.audio import resample

        samples = np.stack([resample(ch, sample_rate, forced_rate) for ch in samples])
        sample_rate = forced_rate
    layout = "mono" if samples.shape[0] == 1 else "stereo"
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=sample_rate, layout=layout)
        frame_size = stream.codec_context.frame_size or 1024
        pcm = np.ascontiguousarray(samples, dtype=np.float32)
        for start in range(0, pcm.shape[1], frame_size):
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(pcm[:, start : start + frame_size]), format="fltp", layout=layout
            )
            frame.sample_rate = sample_rate
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()
