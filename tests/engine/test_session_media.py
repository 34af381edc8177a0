"""A live video session's items cross to the engine process once (vlserve/engine/session_media.py).

Unit tests of the sender / store pair, then `MPAsyncLLM` (the engine in its own process) driving a session on a tiny
Qwen2-VL: answers equal the offline session's (greedy), a question's AddRequests message does not grow with the
window, the store empties when the session closes, items the encoder cache dropped are encoded again from the store,
and a reference the engine cannot fill is sent again, whole."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.multimodal.test_video_session import _frames
from tests.support.chat_templates import QWEN2_VL_CHAT_TEMPLATE
from vlserve.core.request import EngineCoreRequest
from vlserve.engine.dp_router import DPRouter
from vlserve.engine.session_media import SESSION_REF_KEY, SessionMediaMissing, SessionMediaSender, SessionMediaStore
from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.sampling_params import SamplingParams

FPS = 2.0
QUESTION = "What moves?"
ITEM_EMBEDS = 6  # one pair of the 32x64 test frames: a 2x6 patch grid merged 2x2 (asserted below)
ENGINE_KW = dict(dtype="float32", num_kv_blocks=256, block_size=16, max_model_len=1024)


def _item(mm_hash: str, step: int, session: str | None = "s1") -> MultiModalFeature:
    pixels = torch.arange(24 * 8, dtype=torch.float32).reshape(24, 8) + hash(mm_hash) % 7  # [rows, C*tp*p*p]
    data = {"pixel_values_videos": pixels, "video_grid_thw": torch.tensor([[1, 2, 12]]), "video_time_offset": step}
    return MultiModalFeature("video", mm_hash, 10 * step, ITEM_EMBEDS, data, session_id=session)


def test_items_are_sent_whole_once_then_as_references():
    sender, store = SessionMediaSender(2), SessionMediaStore()
    first = sender.outgoing(0, [_item("a", 0), _item("b", 1), _item("x", 2, session=None)])
    assert all(SESSION_REF_KEY not in f.data for f in first)
    assert [f.data["pixel_values_videos"] is not None for f in store.resolve(first)] == [True] * 3
    assert len(store) == 2  # session items only
    later = sender.outgoing(0, [_item("a", 0), _item("b", 5), _item("x", 6, session=None)])
    assert [SESSION_REF_KEY in f.data for f in later] == [True, True, False]
    assert all("pixel_values_videos" not in f.data for f in later[:2])
    filled = store.resolve(later)
    want = _item("b", 5)
    assert torch.equal(filled[1].data["pixel_values_videos"], want.data["pixel_values_videos"])
    assert filled[1].data["video_time_offset"] == 5 and SESSION_REF_KEY not in filled[1].data  # the request's own
    assert SESSION_REF_KEY not in sender.outgoing(1, [_item("a", 0)])[0].data  # another engine: sent whole
    sender.forget(["a"])
    assert store.evict(["a"]) == 1 and len(store) == 1
    assert SESSION_REF_KEY not in sender.outgoing(0, [_item("a", 0)])[0].data  # evicted: whole again
    with pytest.raises(SessionMediaMissing, match="no longer holds media item zz"):
        store.resolve([replace_ref(_item("zz", 0))])
    sender.forget_engine(0)
    assert SESSION_REF_KEY not in sender.outgoing(0, [_item("b", 1)])[0].data


def test_a_refused_reference_is_resent_whole_once():
    sender = SessionMediaSender(1)
    request = EngineCoreRequest("q", [1, 2], SamplingParams(), 0.0, [_item("a", 0)])
    sender.outgoing(0, [_item("a", 0)])
    (sent,) = sender.send_requests("q", 0, [request])
    assert SESSION_REF_KEY in sent.mm_features[0].data
    missing = SessionMediaMissing("gone")
    (again,) = sender.acked("q", missing, may_resend=True)
    assert SESSION_REF_KEY not in again.mm_features[0].data  # whole this time
    assert sender.acked("q", missing, may_resend=True) is None  # refused twice: the caller hears of it
    assert not sender.unacked
    sender.send_requests("r", 0, [request])
    assert sender.acked("r", None, may_resend=True) is None and not sender.unacked
    sender.send_requests("s", 0, [request])
    assert sender.acked("s", missing, may_resend=False) is None and not sender.unacked  # aborted meanwhile


def replace_ref(f: MultiModalFeature) -> MultiModalFeature:
    from vlserve.engine.session_media import as_reference

    return as_reference(f)


def test_a_session_keeps_one_replica_whatever_its_window_holds():
    router = DPRouter(4, margin=8)
    replicas = {router.choose([1, 2, 3], [f"h{i}"], affinity="video-session-1") for i in range(20)}
    assert len(replicas) == 1
    assert len({router.choose([1, 2, 3], [f"h{i}"]) for i in range(20)}) > 1  # by first item without the key


# -- the engine in its own process ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("sm_qwen2_vl")), chat_template=QWEN2_VL_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def offline(ckpt):
    from vlserve import LLM

    return LLM(ckpt, **ENGINE_KW)


@pytest.fixture(scope="module")
def mp_llm(ckpt):
    """No prefix cache and an encoder cache of two items: every question encodes again what the cache dropped."""
    from vlserve.config import EngineArgs
    from vlserve.engine.mp_async_llm import MPAsyncLLM

    args = EngineArgs(model=ckpt, enable_prefix_caching=False, encoder_cache_size=2 * ITEM_EMBEDS, **ENGINE_KW)
    llm = MPAsyncLLM.from_engine_args(args, startup_timeout=120)
    yield llm
    llm.shutdown()


def _offline_text(offline, frames, max_frames: int | None = None) -> list[int]:
    from vlserve import SamplingParams

    with offline.open_video_session(fps=FPS, max_frames=max_frames) as session:
        session.append(list(frames))
        return (
            session.ask(QUESTION, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)).outputs[0].token_ids
        )


async def _ask(session) -> list[int]:
    from vlserve import SamplingParams

    prepared = await session.prepare_question(QUESTION)
    outs = [o async for o in session.answer(prepared, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))]
    return outs[-1].outputs[0].token_ids


def _record_add_sizes(llm, monkeypatch) -> dict[str, int]:
    """The pickled size of every AddRequests the client sends, by user request id."""
    from vlserve.engine.core_messages import AddRequests, encode

    sizes: dict[str, int] = {}
    send = llm.client.send

    def recording_send(msg, engine_index=0):
        if isinstance(msg, AddRequests):
            sizes[msg.user_request_id] = len(encode(msg))
        send(msg, engine_index)

    monkeypatch.setattr(llm.client, "send", recording_send)
    return sizes


@pytest.mark.slow
def test_questions_send_references_and_answer_as_offline(mp_llm, offline, monkeypatch):
    from vlserve.engine.async_video_session import AsyncVideoSessions

    sizes = _record_add_sizes(mp_llm, monkeypatch)
    frames = _frames(16, seed=3)

    runs_before = mp_llm.get_metrics()["vlserve:encoder_runs_total"]

    async def run():
        sessions = AsyncVideoSessions(mp_llm, max_sessions=2, idle_timeout=600)
        session = await sessions.create("m", 0, fps=FPS)
        await session.append(list(frames[:4]))
        at4 = await _ask(session)
        await session.append(list(frames[4:]))
        at16 = await _ask(session)
        chunks = list(session.session.stream.chunks)
        held = mp_llm.get_metrics()["vlserve:session_media_items"]
        await sessions.close(session.session_id)
        return at4, at16, chunks, held, session.session_id

    at4, at16, chunks, held, sid = asyncio.run(run())
    assert at4 == _offline_text(offline, frames[:4])
    assert at16 == _offline_text(offline, frames)
    assert int(chunks[0].data["video_grid_thw"][0].prod()) // 4 == ITEM_EMBEDS  # merge 2x2
    assert len(chunks) == 8  # 8 items: the window outgrows the encoder cache (2 items), questions re-encode
    chunk_bytes = chunks[0].data["pixel_values_videos"].nbytes
    asks = [sizes[rid] for rid in sizes if "-ask-" in rid]
    assert len(asks) == 2
    assert asks[1] - asks[0] < chunk_bytes // 4  # 6 more items cost a few hundred bytes each, not their pixels
    assert sum(sizes.values()) >= 8 * chunk_bytes  # each item crossed whole once
    assert held == 8
    assert mp_llm.get_metrics()["vlserve:encoder_runs_total"] - runs_before > 8  # items the cache dropped ran again
    assert mp_llm.get_metrics()["vlserve:session_media_items"] == 0  # closing emptied the store
    assert not any(mp_llm.engine_loop.session_media.sent)


@pytest.mark.slow
def test_a_reference_the_engine_lost_is_sent_again_whole(mp_llm, offline, monkeypatch):
    from vlserve.engine.async_video_session import AsyncVideoSessions
    from vlserve.engine.core_messages import AddRequests, encode

    frames = _frames(6, seed=5)
    sends: list[tuple[str, int]] = []  # (user request id, pickled size) of every AddRequests
    send = mp_llm.client.send

    def recording_send(msg, engine_index=0):
        if isinstance(msg, AddRequests):
            sends.append((msg.user_request_id, len(encode(msg))))
        send(msg, engine_index)

    async def run():
        sessions = AsyncVideoSessions(mp_llm, max_sessions=2, idle_timeout=600)
        session = await sessions.create("m", 0, fps=FPS)
        await session.append(list(frames))
        first = await _ask(session)
        hashes = [c.mm_hash for c in session.session.stream.chunks]
        with monkeypatch.context() as patch:  # the engine forgets the items, this side does not
            patch.setattr(mp_llm.engine_loop.session_media, "forget", lambda mm_hashes: None)
            await mp_llm.evict_encoder_items(hashes)
        monkeypatch.setattr(mp_llm.client, "send", recording_send)
        again = await _ask(session)
        window_bytes = len(hashes) * session.session.stream.chunks[0].data["pixel_values_videos"].nbytes
        await sessions.close(session.session_id)
        return first, again, window_bytes

    first, again, window_bytes = asyncio.run(run())
    assert first == again == _offline_text(offline, frames)
    (ask_id, ref_size), (resent_id, whole_size) = sends
    assert ask_id == resent_id and ref_size < window_bytes // 10 and whole_size > window_bytes  # refused, then whole
    assert not mp_llm.engine_loop.session_media.unacked
    assert mp_llm.get_metrics()["vlserve:session_media_items"] == 0


@pytest.fixture(scope="module")
def dp_llm(ckpt):
    from vlserve.config import EngineArgs
    from vlserve.engine.mp_async_llm import MPAsyncLLM

    llm = MPAsyncLLM.from_engine_args(EngineArgs(model=ckpt, data_parallel_size=2, **ENGINE_KW), startup_timeout=120)
    yield llm
    llm.shutdown()


async def _session_answers(llm, frames, asks: int = 2, max_frames: int | None = None) -> list[list[int]]:
    """Frames appended a pair at a time, a question after each pair and `asks` at the end."""
    from vlserve.engine.async_video_session import AsyncVideoSessions

    sessions = AsyncVideoSessions(llm, max_sessions=2, idle_timeout=600)
    session = await sessions.create("m", 0, fps=FPS, max_frames=max_frames)
    for start in range(0, len(frames), 2):
        await session.append(list(frames[start : start + 2]))
        await _ask(session)
    answers = [await _ask(session) for _ in range(asks)]
    await session.engine.flush()  # the dropped pairs' evictions answered (their acks carry the store's count)
    held = sum(m["vlserve:session_media_items"] for m in llm.get_replica_metrics())
    await sessions.close(session.session_id)
    return answers, held


@pytest.mark.slow
def test_data_parallel_session_stays_on_one_replica(dp_llm, offline):
    frames = _frames(10, seed=7)
    sent_to: set[int] = set()
    sender = dp_llm.engine_loop.session_media
    outgoing = sender.outgoing

    def recording(engine, features):
        sent_to.add(engine)
        return outgoing(engine, features)

    sender.outgoing = recording
    try:
        answers, held = asyncio.run(_session_answers(dp_llm, frames, max_frames=4))
    finally:
        del sender.outgoing
    assert answers == [_offline_text(offline, frames, max_frames=4)] * 2
    assert held == 2  # the window's two pairs: those that left it were evicted from the store
    assert len(sent_to) == 1  # every prefill and question, whatever the window's first item: the session's replica
    assert [m["vlserve:session_media_items"] for m in dp_llm.get_replica_metrics()] == [0, 0]


@pytest.mark.slow
def test_data_parallel_requests_moved_to_another_replica_carry_their_media(dp_llm, offline, monkeypatch):
    frames = _frames(6, seed=9)
    turns = iter(range(1000))
    monkeypatch.setattr(dp_llm.engine_loop.router, "choose", lambda *args: next(turns) % 2)  # alternate replicas
    held: list[list[float]] = []
    sender = dp_llm.engine_loop.session_media
    forget = sender.forget

    def before_forget(mm_hashes):  # the store counts just before the session's evictions start
        if not held:
            held.append([m["vlserve:session_media_items"] for m in dp_llm.get_replica_metrics()])
        forget(mm_hashes)

    monkeypatch.setattr(sender, "forget", before_forget)
    answers, _ = asyncio.run(_session_answers(dp_llm, frames, asks=3))
    assert answers == [_offline_text(offline, frames)] * 3
    assert all(count > 0 for count in held[0])  # both replicas were sent the items whole
    assert [m["vlserve:session_media_items"] for m in dp_llm.get_replica_metrics()] == [0, 0]


@pytest.mark.slow
def test_qwen3_vl_session_through_the_engine_process(tmp_path_factory):
    """Qwen3-VL chunks: timestamp text, and per-request frame indices that cross in the reference."""
    from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint
    from vlserve import LLM
    from vlserve.config import EngineArgs
    from vlserve.engine.mp_async_llm import MPAsyncLLM

    path = build_qwen3_vl_checkpoint(str(tmp_path_factory.mktemp("sm_qwen3_vl")), chat_template=QWEN2_VL_CHAT_TEMPLATE)
    frames = _frames(8, seed=11)
    want = _offline_text(LLM(path, **ENGINE_KW), frames, max_frames=4)
    llm = MPAsyncLLM.from_engine_args(EngineArgs(model=path, **ENGINE_KW), startup_timeout=120)
    try:
        answers, held = asyncio.run(_session_answers(llm, frames, max_frames=4))
        assert answers == [want] * 2 and held == 2
        assert llm.get_metrics()["vlserve:session_media_items"] == 0
    finally:
        llm.shutdown()
