"""Video pruning end to end through LLM on tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints: rate 0 is token-exact
with no pruning; rate 0.5 gives the prompt the kept count and the greedy tokens of the hand-fed HF oracle
(tests/support/pruning_oracle.py: HF's tower and decoder, numpy's ranking, positions written out by hand); a
request's rate overrides the engine's; the encoder cache keeps one entry per rate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.multimodal.mm_media import rand_video
from tests.support.hf_oracle import HFImageTextOracle
from tests.support.pruning_oracle import hand_positions, per_group_flags, pruned_greedy, whole_video_flags
from vlserve import LLM, SamplingParams

MAX_NEW = 8


def _frames():
    frames = rand_video(8, 64, 96, seed=11)
    frames[:, :32] = frames[0, :32]  # the top half never changes
    # the second temporal group nearly repeats the first (not exactly: equal changes would tie, and two towers'
    # rounding would break the ties differently)
    noise = np.random.RandomState(12).randint(-12, 13, frames[0:2].shape)
    frames[2:4] = np.clip(frames[0:2].astype(np.int64) + noise, 0, 255).astype(np.uint8)
    return frames


class _Qwen3Oracle(HFImageTextOracle):
    """Raw frames at HF's default 24 fps (what vlserve assumes for them), 5.x's video layout read as trained."""

    def video_kwargs(self, videos: list) -> dict:
        from transformers.video_utils import VideoMetadata

        meta = [VideoMetadata(total_num_frames=len(v), fps=24.0, frames_indices=list(range(len(v)))) for v in videos]
        return {"video_metadata": meta, "do_sample_frames": False}

    def adjust(self, inputs):
        from transformers import BatchFeature

        from tests.support.qwen3_vl_checkpoints import trained_video_layout

        tok = self.processor.tokenizer
        names = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
        return BatchFeature(trained_video_layout(inputs, *[tok.convert_tokens_to_ids(t) for t in names]))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def family(request, tmp_path_factory):
    name = request.param
    out = str(tmp_path_factory.mktemp(name))
    if name == "qwen3_vl":
        from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint

        model_dir = build_qwen3_vl_checkpoint(out)
        oracle = _Qwen3Oracle(model_dir, MAX_NEW, vlserve_processor=False)
    else:
        from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

        model_dir = build_qwen2_vl_checkpoint(out, variant=name)
        oracle = HFImageTextOracle(model_dir, MAX_NEW)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256)
    return name, oracle, llm


def _greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _run(llm, text, frames, **kwargs):
    prompt = {"prompt": text, "multi_modal_data": {"video": [frames]}}
    out = llm.generate([prompt], _greedy(), use_tqdm=False, **kwargs)[0]
    return out.prompt_token_ids, out.outputs[0].token_ids


def test_rate_zero_is_token_exact(family):
    _, oracle, llm = family
    text, frames = oracle.text(0, "What happens?", n_videos=1), _frames()
    plain = _run(llm, text, frames)
    assert _run(llm, text, frames, mm_processor_kwargs={"video_pruning_rate": 0.0}) == plain


def test_half_pruned_matches_hand_fed_hf(family):
    name, oracle, llm = family
    text, frames, rate = oracle.text(0, "What happens?", n_videos=1), _frames(), 0.5
    inputs = oracle.inputs(text, videos=[frames])
    ids = inputs["input_ids"][0].tolist()
    plain_ids, _ = _run(llm, text, frames)
    assert plain_ids == ids  # the unpruned layouts agree (the family parity tests check the rest)
    model, cfg = oracle.model, oracle.model.config
    video_id, merge = cfg.video_token_id, cfg.vision_config.spatial_merge_size
    with torch.no_grad():
        feats = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    emb = feats.pooler_output[0]  # [t*h*w, H] HF's tower
    emb_np = emb.float().cpu().numpy()
    t, h, w = (int(v) for v in inputs["video_grid_thw"][0])
    h, w = h // merge, w // merge
    if name == "qwen3_vl":
        flags = per_group_flags(emb_np, t, rate)
        runs, interval, deepstack = [(1, h, w)] * t, 1, [d[0] for d in feats.deepstack_features]
    else:
        flags = whole_video_flags(emb_np, t, rate)
        tps = getattr(cfg.vision_config, "tokens_per_second", None)  # Qwen2.5-VL: t * int(2 / 2.0 fps) * tps
        runs, interval, deepstack = [(t, h, w)], 1 if tps is None else int(2 / 2.0) * tps, None
    assert flags[: h * w].all() and not flags[: int(flags.sum())].all()  # the first group, then not a prefix
    positions = hand_positions(ids, video_id, runs, interval)
    length, expected = pruned_greedy(model, ids, video_id, emb, positions, flags, MAX_NEW, deepstack)
    prompt = {"prompt": text, "multi_modal_data": {"video": [frames]}}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False, mm_processor_kwargs={"video_pruning_rate": rate})[0]
    assert len(out.prompt_token_ids) == length == len(ids) - int((~flags).sum())
    assert out.prompt_token_ids.count(video_id) == int(flags.sum())
    got = out.outputs[0]
    assert got.token_ids == [token for token, _ in expected]
    got_logprobs = [step[token].logprob for step, token in zip(got.logprobs, got.token_ids)]
    assert got_logprobs == pytest.approx([lp for _, lp in expected], abs=2e-4)


def test_encoder_cache_keeps_one_entry_per_rate(family):
    _, oracle, llm = family
    text, frames = oracle.text(0, "Again?", n_videos=1), rand_video(8, 64, 96, seed=21)
    runs = []
    for rate in (0.5, 0.25, 0.5):
        before = llm.get_metrics()["vlserve:encoder_runs_total"]
        _run(llm, text, frames, mm_processor_kwargs={"video_pruning_rate": rate})
        runs.append(llm.get_metrics()["vlserve:encoder_runs_total"] - before)
    assert runs[0] > 0 and runs[1] > 0  # a new rate: encoded again
    assert runs[2] == 0  # the first rate again: served from the encoder cache


def test_request_rate_overrides_the_engine_rate(tmp_path):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    model_dir = build_qwen2_vl_checkpoint(str(tmp_path / "m"), variant="qwen2_vl")
    oracle_text = HFImageTextOracle.text
    pruning = LLM(model_dir, dtype="float32", num_kv_blocks=128, video_pruning_rate=0.5)
    plain = LLM(model_dir, dtype="float32", num_kv_blocks=128)

    class _Tok:  # HFImageTextOracle.text reads only `processor`
        processor = pruning.input_processor.mm_processor.hf_processor

    text, frames = oracle_text(_Tok, 0, "What?", n_videos=1), _frames()
    by_engine = _run(pruning, text, frames)
    assert by_engine == _run(plain, text, frames, mm_processor_kwargs={"video_pruning_rate": 0.5})
    assert _run(pruning, text, frames, mm_processor_kwargs={"video_pruning_rate": 0.0}) == _run(plain, text, frames)
    assert len(by_engine[0]) < len(_run(plain, text, frames)[0])


def test_chunked_prefill_and_shared_encoder_output_give_the_same_tokens(tmp_path):
    """The pruned video's positions are placed whichever step first covers it: a prefill cut into 16-token chunks
    (through the video), and a batch of two requests sharing one encoder output (prefix caching off), answer as
    one whole prefill does."""
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    model_dir = build_qwen2_vl_checkpoint(str(tmp_path / "m"), variant="qwen2_5_vl")
    whole = LLM(model_dir, dtype="float32", num_kv_blocks=128)

    class _Proc:  # HFImageTextOracle.text reads only `processor`
        processor = whole.input_processor.mm_processor.hf_processor

    text, frames, kwargs = HFImageTextOracle.text(_Proc, 0, "What?", n_videos=1), _frames(), {"video_pruning_rate": 0.5}
    expected = _run(whole, text, frames, mm_processor_kwargs=kwargs)
    chunked = LLM(model_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _run(chunked, text, frames, mm_processor_kwargs=kwargs) == expected
    prompt = {"prompt": text, "multi_modal_data": {"video": [frames]}}
    outs = chunked.generate([prompt, prompt], _greedy(), use_tqdm=False, mm_processor_kwargs=kwargs)
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs] == [expected, expected]
    assert chunked.get_metrics()["vlserve:encoder_runs_total"] == 1  # the second request read the first's output
    chunked.engine.check_integrity()


def test_split_encoding_prunes_at_the_last_slice(tmp_path):
    """With an encoder budget of one embedding the video's tower runs a slice of its blocks per step; the pruned
    item is cut at the last slice and answers as the whole encoding does."""
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    model_dir = build_qwen2_vl_checkpoint(str(tmp_path / "m"), variant="qwen2_vl")
    whole = LLM(model_dir, dtype="float32", num_kv_blocks=128)

    class _Proc:  # HFImageTextOracle.text reads only `processor`
        processor = whole.input_processor.mm_processor.hf_processor

    text, frames, kwargs = HFImageTextOracle.text(_Proc, 0, "What?", n_videos=1), _frames(), {"video_pruning_rate": 0.5}
    expected = _run(whole, text, frames, mm_processor_kwargs=kwargs)
    split = LLM(model_dir, dtype="float32", num_kv_blocks=128, max_num_encoder_input_tokens=1)
    steps = []
    schedule = split.engine.scheduler.schedule

    def recording_schedule(*args, **kw):
        so = schedule(*args, **kw)
        steps.append(sum(len(v) for v in so.scheduled_encoder_slices.values()))
        return so

    split.engine.scheduler.schedule = recording_schedule
    assert _run(split, text, frames, mm_processor_kwargs=kwargs) == expected
    assert sum(n > 0 for n in steps) > 1  # the tower ran over several steps


def test_qwen3_steps_pruned_to_nothing_leave_no_item(family):
    name, oracle, llm = family
    if name != "qwen3_vl":
        pytest.skip("Qwen3-VL's per-step items")
    text, frames = oracle.text(0, "What happens?", n_videos=1), _frames()
    processed = llm.input_processor.process_prompt(
        {"prompt": text, "multi_modal_data": {"video": [frames]}}, mm_processor_kwargs={"video_pruning_rate": 0.9}
    )
    steps = processed.prompt_token_ids.count(oracle.processor.tokenizer.convert_tokens_to_ids("<|vision_start|>"))
    assert 1 <= len(processed.mm_features) < steps  # only the first step (and any with a share) is an item
    assert all(f.length > 0 for f in processed.mm_features)
    ids, out = _run(llm, text, frames, mm_processor_kwargs={"video_pruning_rate": 0.9})
    assert len(out) == MAX_NEW


@pytest.mark.slow
def test_tensor_parallel_ranks_prune_alike(tmp_path):
    """Two tensor-parallel ranks each run the tower and the mask: the pruned answer equals one rank's."""
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    model_dir = build_qwen2_vl_checkpoint(str(tmp_path / "m"), variant="qwen2_vl")
    one = LLM(model_dir, dtype="float32", num_kv_blocks=128)

    class _Proc:  # HFImageTextOracle.text reads only `processor`
        processor = one.input_processor.mm_processor.hf_processor

    text, frames = HFImageTextOracle.text(_Proc, 0, "What?", n_videos=1), _frames()
    expected = _run(one, text, frames, mm_processor_kwargs={"video_pruning_rate": 0.5})
    two = LLM(model_dir, dtype="float32", num_kv_blocks=128, tensor_parallel_size=2, video_pruning_rate=0.5)
    try:
        assert _run(two, text, frames) == expected
    finally:
        two.shutdown()


def test_video_sessions_refuse_a_pruning_rate(tmp_path):
    """A live session's frame pairs are not pruned: a session under an engine rate must turn it off explicitly."""
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    model_dir = build_qwen2_vl_checkpoint(str(tmp_path / "m"), variant="qwen2_vl")
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=128, video_pruning_rate=0.5)
    with pytest.raises(ValueError, match="video session's frames are not pruned"):
        llm.open_video_session(fps=2.0)
    with llm.open_video_session(fps=2.0, mm_processor_kwargs={"video_pruning_rate": 0}) as session:
        session.append(_frames()[:4])
        assert (
            len(session.ask("What happens?", SamplingParams(temperature=0.0, max_tokens=2)).outputs[0].token_ids) == 2
        )
