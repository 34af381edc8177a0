"""The audio demo's world: seeded clips, their renderings (pitch, timing, noise) and every answer."""

import io
import random
import wave

import numpy as np
import pytest

from vlserve.demo import audio_world as aw


def beep(pitch, length, start, duration, freq=None):
    return aw.Beep(pitch, length, start, duration, freq or sum(aw.PITCH_HZ[pitch]) / 2, 0.6)


def clip_of(*beeps, seconds=3.0, level=0.02):
    return aw.Clip(tuple(beeps), seconds, "pink", level, 7)


def test_same_seed_same_clip_and_waveform():
    a, b = aw.sample_clip(random.Random(11)), aw.sample_clip(random.Random(11))
    assert a == b
    assert np.array_equal(aw.render(a), aw.render(b))
    assert aw.sample_clip(random.Random(12)) != a


def test_sampled_clips_respect_the_world_rules():
    rng = random.Random(0)
    counts, colours = set(), set()
    for _ in range(300):
        c = aw.sample_clip(rng)
        n = len(c.beeps)
        counts.add(n)
        colours.add(c.noise_colour)
        assert 1 <= n <= aw.MAX_BEEPS and c.seconds <= aw.MAX_SECONDS
        assert all(b1.start + b1.duration < b2.start for b1, b2 in zip(c.beeps, c.beeps[1:])), "beeps never overlap"
        assert c.beeps[-1].start + c.beeps[-1].duration <= c.seconds
        longs = sum(b.length == "long" for b in c.beeps)
        assert longs in (0, 1, n), "'which beep is the longest' has one answer"
        for b in c.beeps:
            lo, hi = aw.LENGTH_SECONDS[b.length]
            assert lo <= b.duration <= hi and aw.PITCH_HZ[b.pitch][0] <= b.freq <= aw.PITCH_HZ[b.pitch][1]
    assert counts == {1, 2, 3, 4, 5} and colours == set(aw.NOISE_COLOURS)


def test_rendering_puts_each_beep_at_its_time_and_pitch():
    c = clip_of(beep("low", "short", 0.3, 0.15), beep("high", "long", 0.8, 0.45), beep("middle", "short", 1.6, 0.12))
    x = aw.render(c)
    assert x.dtype == np.float32 and x.shape == (int(3.0 * aw.SAMPLE_RATE),) and np.abs(x).max() <= 1.0
    for b in c.beeps:
        seg = x[int((b.start + 0.02) * aw.SAMPLE_RATE) : int((b.start + b.duration - 0.02) * aw.SAMPLE_RATE)]
        spectrum = np.abs(np.fft.rfft(seg))
        peak_hz = np.argmax(spectrum) * aw.SAMPLE_RATE / len(seg)
        assert abs(peak_hz - b.freq) < 30, (b, peak_hz)
    gap = x[int(0.5 * aw.SAMPLE_RATE) : int(0.75 * aw.SAMPLE_RATE)]
    tone = x[int(0.9 * aw.SAMPLE_RATE) : int(1.1 * aw.SAMPLE_RATE)]
    assert np.sqrt(np.mean(gap**2)) < 0.1 * np.sqrt(np.mean(tone**2)), "between beeps only the faint noise"


def test_answers_for_every_form():
    c = clip_of(beep("high", "short", 0.2, 0.12), beep("low", "long", 0.6, 0.45), beep("middle", "short", 1.4, 0.15))
    assert [a for _, _, a in aw.qas(c)] == [
        "There are three beeps.",
        "The first beep is high.",
        "The last beep is middle.",
        "The second beep.",
        "Three beeps: high short, low long, middle short.",
    ]
    one = clip_of(beep("low", "short", 0.2, 0.12))
    assert aw.answer(one, "How many beeps are there?") == "There is one beep."
    assert aw.answer(one, "Which beep is the longest?") == "The first beep."
    assert aw.describe(one) == "One beep: low short."
    same = clip_of(beep("low", "long", 0.2, 0.4), beep("low", "long", 0.9, 0.45))
    assert aw.answer(same, " Which beep is the longest?") == "They are all the same length."
    assert aw.answer(same, "Is the last beep high, middle or low?") == "The last beep is low."


def test_bad_questions_and_forms_are_value_errors():
    c = aw.sample_clip(random.Random(1))
    with pytest.raises(ValueError, match="unsupported question"):
        aw.answer(c, "What is the tempo?" * 100)
    with pytest.raises(ValueError, match="form must be one of"):
        aw.sample_qa(random.Random(0), c, "tempo")
    with pytest.raises(ValueError, match="num_beeps"):
        aw.sample_clip(random.Random(0), num_beeps=6)


def test_wav_bytes_round_trip():
    x = aw.render(aw.sample_clip(random.Random(2)))
    with wave.open(io.BytesIO(aw.to_wav_bytes(x))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 16000, len(x))
        back = np.frombuffer(w.readframes(len(x)), "<i2") / 32767
    assert np.abs(back - x).max() < 1e-4
