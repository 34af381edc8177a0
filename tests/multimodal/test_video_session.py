"""Live video sessions (vlserve/engine/video_session.py) end to end through LLM on tiny Qwen2-VL / Qwen2.5-VL.

The oracle: a question after N appends answers (greedy) exactly as one ordinary chat request carrying the same
frames as one video at the same fps, and runs the very same prompt tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tests.support.chat_templates import QWEN2_VL_CHAT_TEMPLATE
from vlserve import LLM, SamplingParams
from vlserve.config import EngineArgs

FPS = 2.0
QUESTION = "What moves?"
SYSTEM = [{"role": "system", "content": "You watch a camera."}]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def llm(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp(request.param))
    if request.param == "qwen3_vl":
        from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint

        path = build_qwen3_vl_checkpoint(out, chat_template=QWEN2_VL_CHAT_TEMPLATE)
    else:
        from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

        path = build_qwen2_vl_checkpoint(out, variant=request.param, chat_template=QWEN2_VL_CHAT_TEMPLATE)
    return LLM(path, dtype="float32", num_kv_blocks=256, block_size=16, max_video_sessions=2)


def _frames(n: int, seed: int = 0) -> np.ndarray:
    """[n, 32, 64, 3] uint8: a bright square moving over noise. Small enough that Qwen3-VL's video processor,
    which sizes frames by the pixels of the whole clip, sizes every pair as it sizes a clip of a dozen frames."""
    rng = np.random.RandomState(seed)
    frames = rng.randint(0, 120, (n, 32, 64, 3), dtype=np.uint8)
    for i in range(n):
        x = (7 * i) % 50
        frames[i, 10:24, x : x + 14] = 255
    return frames


def _greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _one_request(llm: LLM, frames: np.ndarray, messages=None):
    """The oracle: one chat request carrying `frames` as one video given at mm_processor_kwargs' fps (Qwen3-VL's
    timestamps count at that fps)."""
    video = list(frames)
    turn = {"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": QUESTION}]}
    return llm.chat((messages or []) + [turn], _greedy(), use_tqdm=False, mm_processor_kwargs={"fps": FPS})[0]


def _pool_state(llm: LLM) -> tuple[int, int]:
    sched = llm.engine.scheduler
    return sched.kv.pool.num_free_blocks, sched.encoder_cache.num_used


def test_answers_equal_one_request(llm):
    frames = _frames(9)
    with llm.open_video_session(SYSTEM, fps=FPS) as session:
        seen = 0
        for n in (3, 1, 4, 1):  # odd appends: a frame waits for its pair, a question carries it padded
            session.append([Image.fromarray(f) for f in frames[seen : seen + n]] if n == 1 else list(frames[seen:][:n]))
            seen += n
            answer = session.ask(QUESTION, _greedy())
            ref = _one_request(llm, frames[:seen], SYSTEM)
            assert answer.prompt_token_ids == ref.prompt_token_ids
            assert answer.outputs[0].token_ids == ref.outputs[0].token_ids
    llm.check_integrity()


def test_question_hits_the_prefix_cache(llm):
    """Every full block of the prefix (head + whole pairs) is cached when the question arrives and every pair's
    embeddings too: the question computes only its own tokens and the prefix's last partial block, and runs no
    tower, however long the stream."""
    frames = _frames(12, seed=3)
    block = llm.engine_args.block_size
    with llm.open_video_session(fps=FPS) as session:
        computed = []
        for start in range(0, 12, 4):
            session.append(list(frames[start : start + 4]))
            prefix_len = len(session.stream.prompt(session.head, None).prompt_token_ids)
            misses = llm.get_metrics()["vlserve:encoder_cache_misses_total"]
            answer = session.ask(QUESTION, _greedy(2))
            assert llm.get_metrics()["vlserve:encoder_cache_misses_total"] == misses  # no pair encoded again
            assert answer.num_cached_tokens >= prefix_len // block * block
            computed.append(len(answer.prompt_token_ids) - answer.num_cached_tokens)
        assert max(computed) <= block + len(answer.prompt_token_ids) - prefix_len
    llm.check_integrity()


@pytest.mark.parametrize("window", [{"max_frames": 5}, {"max_seconds": 2.0}])
def test_window_answers_equal_one_request_of_the_window(llm, window):
    frames = _frames(11, seed=5)
    with llm.open_video_session(fps=FPS, **window) as session:
        for start in range(0, 11, 3):
            session.append(list(frames[start : start + 3]))
            seen = min(start + 3, 11)
            # whole pairs go first: the window keeps at most 5 (or 2 s * 2 fps = 4) frames, the last odd one included
            limit = window.get("max_frames") or int(window["max_seconds"] * FPS)
            kept = seen - ((seen - limit + 1) // 2 * 2 if seen > limit else 0)
            assert session.stream.num_frames == kept
            answer = session.ask(QUESTION, _greedy())
            ref = _one_request(llm, frames[seen - kept : seen])
            assert answer.prompt_token_ids == ref.prompt_token_ids
            assert answer.outputs[0].token_ids == ref.outputs[0].token_ids
    llm.check_integrity()


def test_window_slack_drops_below_the_limit(llm):
    """max_frames=6, window_slack=2: an overflow drops pairs until at most 4 frames remain (then 3: 9 -> 3 frames),
    so the positions restart once in a while rather than at every append; answers still equal one request's."""
    frames = _frames(15, seed=6)
    kept_after = []
    with llm.open_video_session(fps=FPS, max_frames=6, window_slack=2) as session:
        for start in range(0, 15, 3):
            session.append(list(frames[start : start + 3]))
            kept = session.stream.num_frames
            kept_after.append(kept)
            answer = session.ask(QUESTION, _greedy())
            ref = _one_request(llm, frames[start + 3 - kept : start + 3])
            assert answer.outputs[0].token_ids == ref.outputs[0].token_ids
    assert kept_after == [3, 6, 3, 6, 3]
    with pytest.raises(ValueError, match="window_slack"):
        llm.open_video_session(max_frames=6, window_slack=5)


def test_close_returns_blocks_and_encoder_cache(llm):
    llm.engine.scheduler.encoder_cache.reset()
    start = _pool_state(llm)
    session = llm.open_video_session(fps=FPS, max_frames=4)
    for i in range(0, 9, 3):
        session.append(list(_frames(3, seed=10 + i)))
    session.ask(QUESTION, _greedy(2))
    assert _pool_state(llm)[1] > start[1]
    session.close()
    session.close()  # idempotent
    assert _pool_state(llm) == start
    llm.check_integrity()
    with pytest.raises(ValueError, match="closed"):
        session.ask(QUESTION)


def test_session_bounds(llm):
    now = [0.0]
    llm.video_sessions.clock = lambda: now[0]
    try:
        a = llm.open_video_session()
        b = llm.open_video_session()
        with pytest.raises(ValueError, match="max_video_sessions=2"):
            llm.open_video_session()
        b.close()
        c = llm.open_video_session()  # a closed one no longer counts
        now[0] += llm.engine_args.session_idle_timeout + 1
        d = llm.open_video_session()  # a and c expired
        assert a.closed and c.closed and not d.closed
        with pytest.raises(ValueError, match="closed"):
            a.append(list(_frames(2)))
        now[0] += llm.engine_args.session_idle_timeout / 2
        d.append(list(_frames(2)))  # use restarts the idle clock
        now[0] += llm.engine_args.session_idle_timeout / 2 + 1
        assert not d.closed
        now[0] += llm.engine_args.session_idle_timeout / 2
        with pytest.raises(ValueError, match="expired"):
            d.ask(QUESTION)  # idle too long: closed on its next use, no other session needed
        assert d.closed
        e, f = llm.open_video_session(), llm.open_video_session()
        e.append(list(_frames(2)))
        del e  # dropped unclosed: forgotten, so a third may open
        llm.open_video_session().close()
        f.close()
    finally:
        llm.video_sessions.clock = __import__("time").monotonic


def test_bad_input(llm, monkeypatch):
    with llm.open_video_session() as session:
        with pytest.raises(ValueError, match="no frames"):
            session.ask(QUESTION)
        with pytest.raises(ValueError, match="uint8"):
            session.append([np.zeros((56, 84, 3), dtype=np.float32)])
        with pytest.raises(ValueError, match="at least one frame"):
            session.append([])
        monkeypatch.setattr(llm.input_processor.mm_processor, "max_image_pixels", 32 * 63)
        with pytest.raises(ValueError, match="pixel limit"):
            session.append(list(_frames(2)))
        monkeypatch.undo()
        session.append(list(_frames(2)))
        with pytest.raises(ValueError, match="differ"):
            session.append([np.zeros((28, 28, 3), dtype=np.uint8)])
    with llm.open_video_session(fps=FPS) as session:
        session.append(list(_frames(3)))
        before = session.ask_prompt(QUESTION).prompt_token_ids
        session.max_model_len = len(session.stream.prompt(session.head, None).prompt_token_ids) + 1  # no next pair
        with pytest.raises(ValueError, match="max_model_len"):
            session.append(list(_frames(2)))
        assert session.stream.num_frames == 3 and session.ask_prompt(QUESTION).prompt_token_ids == before
    with pytest.raises(ValueError, match="text only"):
        llm.open_video_session([{"role": "user", "content": [{"type": "image", "image": _frames(1)[0]}]}])
    with pytest.raises(ValueError, match="at least 2 frames"):
        llm.open_video_session(max_frames=1)
    with pytest.raises(ValueError, match="max_frames must be in"):
        llm.open_video_session(max_frames=llm.input_processor.mm_processor.max_video_frames + 1)
    with pytest.raises(ValueError, match="max_seconds"):
        llm.open_video_session(fps=2.0, max_seconds=1000)
    with pytest.raises(ValueError, match="not sampled"):
        llm.open_video_session(mm_processor_kwargs={"num_frames": 4})
    with pytest.raises(ValueError, match="max_video_sessions"):
        EngineArgs(model=llm.engine_args.model, max_video_sessions=0)


@pytest.mark.parametrize("tokens_per_second", [None, 2])  # Qwen2-VL; Qwen2.5-VL (time scaled by fps)
@pytest.mark.parametrize("grid_hw", [(4, 6), (2, 2)])  # h/w larger than t, and t soon larger than h/w
def test_mrope_chunks_continue_one_video(tokens_per_second, grid_hw):
    """Items carrying `video_time_offset` get the positions of the same steps inside one whole-video item."""
    from types import SimpleNamespace

    import torch

    from vlserve.multimodal.inputs import MultiModalFeature
    from vlserve.multimodal.mrope import get_mrope_positions

    cfg = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2, tokens_per_second=tokens_per_second))
    h, w = grid_hw
    steps, per_step, spg = 5, h * w // 4, torch.tensor([1.0])
    before, after = [7] * 3, [8] * 4
    ids = before + [9] * steps * per_step + after
    whole = MultiModalFeature("video", "v", 3, steps * per_step, {"video_grid_thw": torch.tensor([[steps, h, w]])})
    whole.data["second_per_grid_ts"] = spg
    chunks = [
        MultiModalFeature(
            "video",
            f"c{k}",
            3 + k * per_step,
            per_step,
            {"video_grid_thw": torch.tensor([[1, h, w]]), "second_per_grid_ts": spg, "video_time_offset": k},
        )
        for k in range(steps)
    ]
    expected, expected_delta = get_mrope_positions(ids, [whole], cfg)
    got, delta = get_mrope_positions(ids, chunks, cfg)
    assert torch.equal(got, expected) and delta == expected_delta
    chunks[2].offset += 1  # a token between: the item no longer follows the video
    chunks[3].offset += 1
    chunks[4].offset += 1
    with pytest.raises(ValueError, match="does not follow a video item"):
        get_mrope_positions(ids + [8], chunks, cfg)


def test_tower_encodes_pairs_as_the_whole_clip(llm):
    """Each temporal grid step attends only within itself (and Qwen3-VL's frames are items already): the chunks'
    embeddings, concatenated, are the whole clip's (the processor sizes every frame alike here)."""
    import torch

    mm = llm.input_processor.mm_processor
    frames = _frames(6, seed=7)
    _, whole = mm.process_video(list(frames), {}, {"fps": FPS})
    with llm.open_video_session(fps=FPS) as session:
        session.append(list(frames))
        _, features = session.stream.video_run(with_pending=False)
    model = llm.engine.runner.model
    if mm.qwen3_videos is not None:
        whole_embeds = torch.cat(
            [model.embed_multimodal("video", f.data) for f in mm.qwen3_videos.expand("v", whole, 0)[1]]
        )
    else:
        whole_embeds = model.embed_multimodal("video", whole)  # [3 * h * w / 4, H]
    chunk_embeds = torch.cat([model.embed_multimodal("video", f.data) for f in features])
    assert len(features) == 3
    torch.testing.assert_close(chunk_embeds, whole_embeds, rtol=1e-5, atol=1e-5)


def test_extend_returns_the_prefix_a_question_starts_with(llm):
    """The split an async server uses: `extend` (no engine call) returns the prefix to prefill once a pair is
    complete; a question's prompt starts with it."""
    frames = _frames(3, seed=9)
    with llm.open_video_session(fps=FPS) as session:
        assert session.extend([frames[0]]) is None  # half a pair
        prefix = session.extend(list(frames[1:]))
        n = len(prefix.prompt_token_ids)
        question = session.ask_prompt(QUESTION)
        assert question.prompt_token_ids[:n] == prefix.prompt_token_ids and len(question.prompt_token_ids) > n
        assert [f.mm_hash for f in prefix.mm_features] == [f.mm_hash for f in question.mm_features[:1]]
        assert len(question.mm_features) == 2  # the waiting third frame, padded


def test_ask_defaults_to_the_llm_default_sampling_params(llm, monkeypatch):
    monkeypatch.setattr(llm, "get_default_sampling_params", lambda: _greedy(3))
    frames = _frames(2, seed=11)
    with llm.open_video_session(fps=FPS) as session:
        session.append(list(frames))
        answer = session.ask(QUESTION)
    assert answer.outputs[0].token_ids == _one_request(llm, frames).outputs[0].token_ids[:3]
