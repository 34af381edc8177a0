"""The audio demo's synthetic world: clips of beeps over noise, their renderings, and every question form with its
deterministic answer.

A clip holds 1-5 beeps, each of one of 3 pitches (low, middle, high: well-separated frequency bands, jittered) and
one of 2 lengths (short, long), separated by random gaps after a random offset, over noise of varied colour (white,
pink, brown) and level; 16 kHz mono, at most MAX_SECONDS long. So that "Which beep is the longest?" always has one
answer, a clip has no long beep, exactly one, or only long ones ("They are all the same length." when there are two
or more beeps of one length). A clip fixes everything its rendering needs (including the noise seed), so
`render(clip)` is deterministic.
"""

from __future__ import annotations

import io
import random
import wave
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16000
MAX_SECONDS = 5.0  # the feature extractor's chunk: no clip is longer
PITCHES = ("low", "middle", "high")
PITCH_HZ = {"low": (280.0, 380.0), "middle": (750.0, 950.0), "high": (1900.0, 2400.0)}  # frequency range per pitch
LENGTHS = ("short", "long")
LENGTH_SECONDS = {"short": (0.10, 0.18), "long": (0.38, 0.50)}
GAP_SECONDS = (0.12, 0.30)  # silence (noise only) between two beeps
OFFSET_SECONDS = (0.05, 0.50)  # before the first beep
TAIL_SECONDS = (0.05, 0.40)  # after the last beep
NOISE_COLOURS = ("white", "pink", "brown")
MAX_BEEPS = 5
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five")
ORDINALS = ("first", "second", "third", "fourth", "fifth")

FORMS = ("count", "first_pitch", "last_pitch", "longest", "describe")
QUESTION_TEMPLATES = {
    "count": "How many beeps are there?",
    "first_pitch": "Is the first beep high, middle or low?",
    "last_pitch": "Is the last beep high, middle or low?",
    "longest": "Which beep is the longest?",
    "describe": "Describe the audio.",
}


@dataclass(frozen=True)
class Beep:
    """One beep: pitch and length names, start and duration in seconds, frequency in Hz, amplitude (0-1)."""

    pitch: str
    length: str
    start: float
    duration: float
    freq: float
    amplitude: float


@dataclass(frozen=True)
class Clip:
    """A clip: its beeps in time order, total duration in seconds, and the background noise (colour, level, seed)."""

    beeps: tuple[Beep, ...]
    seconds: float
    noise_colour: str
    noise_level: float
    seed: int


def _lengths(rng: random.Random, n: int) -> list[str]:
    """Length names for n beeps: all short, all long, or exactly one long (chosen uniformly among the three plans)."""
    plan = rng.choice(("short", "long", "one_long"))
    if plan == "one_long" or n == 1 and plan == "long":
        lengths = ["short"] * n
        lengths[rng.randrange(n)] = "long"
        return lengths
    return [plan] * n


def sample_clip(rng: random.Random, num_beeps: int | None = None) -> Clip:
    """A random clip (num_beeps uniform in 1..MAX_BEEPS unless given); deterministic given the rng state."""
    n = num_beeps or rng.randint(1, MAX_BEEPS)
    if not 1 <= n <= MAX_BEEPS:
        raise ValueError(f"num_beeps must be in 1..{MAX_BEEPS}, got {num_beeps!r}")
    beeps, t = [], rng.uniform(*OFFSET_SECONDS)
    for _i, length in enumerate(_lengths(rng, n)):
        pitch = rng.choice(PITCHES)
        duration = rng.uniform(*LENGTH_SECONDS[length])
        beeps.append(
            Beep(pitch, length, round(t, 4), round(duration, 4), rng.uniform(*PITCH_HZ[pitch]), rng.uniform(0.25, 0.8))
        )
        t += duration + rng.uniform(*GAP_SECONDS)
    seconds = min(MAX_SECONDS, beeps[-1].start + beeps[-1].duration + rng.uniform(*TAIL_SECONDS))
    return Clip(
        tuple(beeps), round(seconds, 4), rng.choice(NOISE_COLOURS), rng.uniform(0.0, 0.12), rng.randrange(2**31)
    )


def _noise(gen: np.random.Generator, colour: str, n: int) -> np.ndarray:
    """n samples of unit-RMS noise of the given colour (pink: 1/f power, brown: 1/f^2), float64."""
    white = gen.standard_normal(n)
    if colour != "white":
        spectrum = np.fft.rfft(white)
        f = np.maximum(np.arange(spectrum.shape[0]), 1.0)
        spectrum /= np.sqrt(f) if colour == "pink" else f
        white = np.fft.irfft(spectrum, n)
    return white / max(float(np.sqrt(np.mean(white**2))), 1e-9)


def render(clip: Clip) -> np.ndarray:
    """The clip's waveform: float32 [samples] at SAMPLE_RATE, in [-1, 1]."""
    n = int(round(clip.seconds * SAMPLE_RATE))
    gen = np.random.default_rng(clip.seed)
    wave_ = clip.noise_level * _noise(gen, clip.noise_colour, n)
    ramp = int(0.01 * SAMPLE_RATE)  # 10 ms fade in / out: no clicks
    for b in clip.beeps:
        start, length = int(b.start * SAMPLE_RATE), int(b.duration * SAMPLE_RATE)
        length = min(length, n - start)
        tt = np.arange(length) / SAMPLE_RATE
        env = np.ones(length)
        env[:ramp] = np.linspace(0.0, 1.0, min(ramp, length))[: min(ramp, length)]
        env[-ramp:] = np.minimum(env[-ramp:], np.linspace(1.0, 0.0, ramp)[-min(ramp, length) :])
        phase = gen.uniform(0, 2 * np.pi)
        wave_[start : start + length] += b.amplitude * env * np.sin(2 * np.pi * b.freq * tt + phase)
    return np.clip(wave_, -1.0, 1.0).astype(np.float32)


def to_wav_bytes(samples: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """16-bit PCM mono WAV file bytes for float samples in [-1, 1]."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes((np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _number(n: int) -> str:
    return f"There is {NUMBER_WORDS[n]} beep." if n == 1 else f"There are {NUMBER_WORDS[n]} beeps."


def _longest(clip: Clip) -> str:
    longs = [i for i, b in enumerate(clip.beeps) if b.length == "long"]
    if len(clip.beeps) == 1:
        return "The first beep."
    if len(longs) == 1:
        return f"The {ORDINALS[longs[0]]} beep."
    return "They are all the same length."


def describe(clip: Clip) -> str:
    """E.g. "Three beeps: high short, low long, middle short." (one beep: "One beep: low long.")."""
    n = len(clip.beeps)
    parts = ", ".join(f"{b.pitch} {b.length}" for b in clip.beeps)
    return f"{NUMBER_WORDS[n].capitalize()} beep{'s' if n > 1 else ''}: {parts}."


def qas(clip: Clip) -> list[tuple[str, str, str]]:
    """Every (form, question, answer) about the clip, in FORMS order."""
    answers = {
        "count": _number(len(clip.beeps)),
        "first_pitch": f"The first beep is {clip.beeps[0].pitch}.",
        "last_pitch": f"The last beep is {clip.beeps[-1].pitch}.",
        "longest": _longest(clip),
        "describe": describe(clip),
    }
    return [(f, QUESTION_TEMPLATES[f], answers[f]) for f in FORMS]


def sample_qa(rng: random.Random, clip: Clip, form: str | None = None) -> tuple[str, str, str]:
    """One (form, question, answer): a uniformly chosen form, or the given one."""
    if form is not None and form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    form = form or rng.choice(FORMS)
    return next(qa for qa in qas(clip) if qa[0] == form)


def answer(clip: Clip, question: str) -> str:
    """The answer to `question` (one of the supported forms, exact text) about `clip`; ValueError otherwise."""
    for _, q, a in qas(clip):
        if q == question.strip():
            return a
    raise ValueError(
        f"unsupported question for this clip: {question[:100]!r}; ask one of {list(QUESTION_TEMPLATES.values())}"
    )
