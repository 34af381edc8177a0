"""Live video sessions over HTTP (vlserve/api/video_sessions.py) on a tiny Qwen2-VL: REST routes, the WebSocket
protocol, what closing frees in the engine. The oracle: an answer after N frames equals (greedy) the offline
`LLM.open_video_session`'s, itself one ordinary request's with those frames (tests/multimodal/test_video_session)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from starlette.websockets import WebSocketDisconnect

from tests.multimodal.test_video_session import _frames  # [n, 32, 64, 3] uint8: a square moving over noise
from tests.support.chat_templates import QWEN2_VL_CHAT_TEMPLATE
from vlserve import LLM, SamplingParams
from vlserve.api.server import ServerConfig, build_app
from vlserve.config import EngineArgs
from vlserve.engine.async_llm import AsyncLLM
from vlserve.engine.async_video_session import AsyncVideoSession

FPS = 2.0
QUESTION = "What moves?"
ENGINE_KW = dict(dtype="float32", num_kv_blocks=256, block_size=16, max_model_len=1024, max_video_sessions=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("ws_qwen2_vl")), chat_template=QWEN2_VL_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def engine(ckpt):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=ckpt, **ENGINE_KW))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, ServerConfig(shutdown_engine=False))) as c:
        yield c


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, **ENGINE_KW)


def _png(frame: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")  # lossless: the server sees the very pixels
    return buf.getvalue()


def _data_url(frame: np.ndarray) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(frame)).decode()


def _offline_answer(offline: LLM, frames: np.ndarray, max_tokens: int = 8):
    with offline.open_video_session(fps=FPS) as session:
        session.append(list(frames))
        return session.ask(QUESTION, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def _open(client, **body) -> dict:
    r = client.post("/v1/video/sessions", json={"fps": FPS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _receive_until(ws, kind: str) -> tuple[dict, list[dict]]:
    """Messages up to the first of type `kind`: (that one, the ones before it)."""
    got = [ws.receive_json()]
    while got[-1]["type"] != kind:
        got.append(ws.receive_json())
    return got[-1], got[:-1]


def _ask(ws, question_id: str, max_tokens: int = 8, **fields) -> None:
    msg = {"type": "question", "question_id": question_id, "question": QUESTION, "max_tokens": max_tokens}
    ws.send_text(json.dumps({**msg, "temperature": 0.0, **fields}))


def test_answer_equals_the_offline_session(client, offline):
    frames = _frames(5)
    session = _open(client)
    assert session["object"] == "video.session" and session["frames"] == 0 and session["fps"] == FPS
    with client.websocket_connect(f"/v1/video/sessions/{session['id']}") as ws:
        ready = ws.receive_json()
        assert ready == {"type": "session.ready", "session": session}
        for i, frame in enumerate(frames[:3]):  # binary frames
            ws.send_bytes(_png(frame))
            assert ws.receive_json() == {"type": "frames.appended", "frames": i + 1, "window_frames": i + 1}
        _ask(ws, "a")
        done, deltas = _receive_until(ws, "answer.done")
        ref = _offline_answer(offline, frames[:3])
        assert done["text"] == ref.outputs[0].text
        assert "".join(d["delta"] for d in deltas if d["type"] == "answer.delta") == done["text"]
        assert all(d["question_id"] == "a" for d in deltas)
        assert done["frames"] == 3 and done["finish_reason"] == "length"
        assert done["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
        assert done["usage"]["completion_tokens"] == 8 and done["ttft_ms"] >= 0
        ws.send_text(json.dumps({"type": "frames.append", "frames": [_data_url(f) for f in frames[3:]]}))
        assert ws.receive_json() == {"type": "frames.appended", "frames": 5, "window_frames": 5}
        _ask(ws, "b")
        done, _ = _receive_until(ws, "answer.done")
        text = _offline_answer(offline, frames).outputs[0].text
        assert done["text"] == text and done["frames"] == 5
        stop = text[len(text) // 2 :][:2]  # a stop string: the answer ends before its first occurrence
        _ask(ws, "c", stop=[stop])
        done, deltas = _receive_until(ws, "answer.done")
        assert done["text"] == text[: text.index(stop)] and done["finish_reason"] == "stop"
        assert "".join(d["delta"] for d in deltas) == done["text"]
    info = client.get(f"/v1/video/sessions/{session['id']}").json()
    assert info["frames"] == 5 and info["window_frames"] == 5  # the session outlives its connection
    deleted = client.delete(f"/v1/video/sessions/{session['id']}").json()
    assert deleted == {"id": session["id"], "object": "video.session.deleted", "deleted": True}


def _engine_state(engine) -> tuple[int, int]:
    """(free KV blocks, encoder-cache slots in use) of the in-process engine core (read while it is idle)."""
    sched = engine.engine.scheduler
    return sched.kv.pool.num_free_blocks, sched.encoder_cache.num_used


def test_append_runs_while_an_answer_streams(client, offline, monkeypatch):
    """An answer held back until the test releases it: frames sent after the question are appended meanwhile, and
    the answer is the one over the frames present when its question arrived."""
    release = threading.Event()
    answer = AsyncVideoSession.answer

    async def held(self, prepared, params):
        await asyncio.to_thread(release.wait, 60)
        async for out in answer(self, prepared, params):
            yield out

    monkeypatch.setattr(AsyncVideoSession, "answer", held)
    frames = _frames(4, seed=2)
    session = _open(client)
    with client.websocket_connect(f"/v1/video/sessions/{session['id']}") as ws:
        ws.receive_json()
        ws.send_text(json.dumps({"type": "frames.append", "frames": [_data_url(f) for f in frames[:2]]}))
        assert ws.receive_json()["frames"] == 2
        _ask(ws, "held")
        ws.send_bytes(_png(frames[2]))
        ws.send_bytes(_png(frames[3]))
        assert ws.receive_json() == {"type": "frames.appended", "frames": 3, "window_frames": 3}
        assert ws.receive_json() == {"type": "frames.appended", "frames": 4, "window_frames": 4}
        release.set()
        done, _ = _receive_until(ws, "answer.done")
        assert done["question_id"] == "held" and done["frames"] == 2
        assert done["text"] == _offline_answer(offline, frames[:2]).outputs[0].text
        monkeypatch.undo()
        _ask(ws, "after")
        done, _ = _receive_until(ws, "answer.done")
        assert done["frames"] == 4 and done["text"] == _offline_answer(offline, frames).outputs[0].text
    client.delete(f"/v1/video/sessions/{session['id']}")


def _expect_error(ws, param: str | None, match: str, question_id: str | None = None) -> dict:
    msg = ws.receive_json()
    assert msg["type"] == "error", msg
    assert msg["error"]["code"] == 400 and msg["error"]["param"] == param, msg
    assert match in msg["error"]["message"], msg
    assert msg.get("question_id") == question_id
    return msg


def test_bad_messages_keep_the_connection(client):
    session = _open(client)
    with client.websocket_connect(f"/v1/video/sessions/{session['id']}") as ws:
        ws.receive_json()
        ws.send_text("{not json")
        _expect_error(ws, None, "invalid JSON")
        ws.send_text(json.dumps({"type": "frames.push", "frames": []}))
        _expect_error(ws, "type", "unknown message type")
        ws.send_text(json.dumps({"type": "question", "question_id": "q0", "question": QUESTION}))
        _expect_error(ws, None, "no frames yet", "q0")
        ws.send_bytes(b"not an image")
        _expect_error(ws, "frames", "not a decodable image")
        ws.send_text(json.dumps({"type": "frames.append", "frames": ["https://example.com/a.png"]}))
        _expect_error(ws, "frames.0", "data:image")
        ws.send_text(json.dumps({"type": "frames.append", "frames": ["data:image/png;base64,@@@"]}))
        _expect_error(ws, "frames.0", "not valid base64")
        ws.send_text(json.dumps({"type": "frames.append", "frames": [_data_url(_frames(1)[0])], "fps": 4}))
        _expect_error(ws, "fps", "unknown field")
        ws.send_bytes(_png(_frames(1)[0]))
        assert ws.receive_json()["type"] == "frames.appended"
        ws.send_bytes(_png(np.zeros((28, 28, 3), dtype=np.uint8)))
        _expect_error(ws, "frames", "differ from the session's")
        _ask(ws, "q1", temperature=-1.0)
        _expect_error(ws, "temperature", "temperature", "q1")
        _ask(ws, "q2", best_of=2)
        _expect_error(ws, "best_of", "unknown field", "q2")
        ws.send_text(json.dumps({"type": "question", "question": 7}))
        _expect_error(ws, "question", "string")
        _ask(ws, "q4", max_tokens=5000)  # more than the context holds: the engine's refusal
        _expect_error(ws, "max_tokens", "max_model_len", "q4")
        _ask(ws, "q3", max_tokens=2)  # the connection still answers, and sees the one good frame
        done, _ = _receive_until(ws, "answer.done")
        assert done["question_id"] == "q3" and done["frames"] == 1 and done["usage"]["completion_tokens"] <= 2
    client.delete(f"/v1/video/sessions/{session['id']}")


def test_disconnect_aborts_answers_and_keeps_the_session(client, engine):
    session = _open(client)
    aborted = engine.num_aborted
    with client.websocket_connect(f"/v1/video/sessions/{session['id']}") as ws:
        ws.receive_json()
        ws.send_text(json.dumps({"type": "frames.append", "frames": [_data_url(f) for f in _frames(2, seed=3)]}))
        ws.receive_json()
        _ask(ws, "long", max_tokens=900)
        assert ws.receive_json()["type"] == "answer.delta"  # then the client leaves mid-answer
    deadline = time.monotonic() + 60
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_aborted == aborted + 1  # the answer, not run to its 900 tokens
    assert client.get(f"/v1/video/sessions/{session['id']}").json()["frames"] == 2
    client.delete(f"/v1/video/sessions/{session['id']}")


def test_unknown_session_socket_closes_4404(client):
    with client.websocket_connect("/v1/video/sessions/video-session-nope") as ws:
        msg = ws.receive_json()
        assert msg["type"] == "error" and msg["error"]["code"] == 404
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
    assert closed.value.code == 4404


def test_rest_errors(client):
    assert client.get("/v1/video/sessions/nope").status_code == 404
    r = client.delete("/v1/video/sessions/nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "id"
    for body, param in [
        ({"fps": 2.0, "frame_rate": 3}, "frame_rate"),  # unknown field
        ({"fps": 0}, "fps"),
        ({"max_frames": 10**6}, "max_frames"),
        ({"max_seconds": 10**6}, "max_seconds"),
        ({"max_frames": 6, "window_slack": 5}, "window_slack"),
        ({"mm_processor_kwargs": {"num_frames": 4}}, "mm_processor_kwargs"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ]:
        r = client.post("/v1/video/sessions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    r = client.post("/v1/video/sessions", json={"model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    opened = [_open(client)["id"] for _ in range(2)]  # max_video_sessions=2
    r = client.post("/v1/video/sessions", json={})
    assert r.status_code == 429 and "max-video-sessions" in r.json()["error"]["message"]
    client.delete(f"/v1/video/sessions/{opened[0]}")
    opened[0] = _open(client)["id"]  # a deleted one no longer counts
    for sid in opened:
        client.delete(f"/v1/video/sessions/{sid}")


def test_delete_and_close_free_kv_and_encoder_entries(client, engine):
    frames = _frames(6, seed=4)
    for ending in ("delete", "close"):
        before = _engine_state(engine)
        session = _open(client, max_frames=4)
        with client.websocket_connect(f"/v1/video/sessions/{session['id']}") as ws:
            ws.receive_json()
            for frame in frames:  # the window drops the oldest pairs as it goes
                ws.send_bytes(_png(frame))
                ws.receive_json()
            _ask(ws, "a", max_tokens=2)
            _receive_until(ws, "answer.done")
            assert _engine_state(engine)[1] > before[1]  # the window's pairs are cached
            if ending == "delete":
                assert client.delete(f"/v1/video/sessions/{session['id']}").status_code == 200
            else:
                ws.send_text(json.dumps({"type": "session.close"}))
            closed = ws.receive_json()
            assert closed == {"type": "session.closed", "id": session["id"], "reason": f"{ending}d"}
            assert ws.receive()["code"] == 1000
        assert client.get(f"/v1/video/sessions/{session['id']}").status_code == 404
        assert _engine_state(engine) == before
    engine.engine.check_integrity()


def test_idle_sessions_expire(client, engine):
    sessions = client.app.state.video_sessions
    now = [0.0]
    sessions.bounds.clock = lambda: now[0]
    try:
        before = _engine_state(engine)
        session = _open(client)
        idle = engine.engine_args.session_idle_timeout
        with client.websocket_connect(f"/v1/video/sessions/{session['id']}") as ws:
            ws.receive_json()
            ws.send_bytes(_png(_frames(1)[0]))
            ws.send_bytes(_png(_frames(2)[1]))
            ws.receive_json(), ws.receive_json()
            now[0] += idle / 2
            assert client.get(f"/v1/video/sessions/{session['id']}").status_code == 200
            now[0] += idle / 2 + 1  # idle since the last append: a connected socket does not keep it open
            assert client.get(f"/v1/video/sessions/{session['id']}").status_code == 404
            assert ws.receive_json() == {"type": "session.closed", "id": session["id"], "reason": "expired"}
        assert _engine_state(engine) == before
    finally:
        sessions.bounds.clock = time.monotonic


def test_model_without_video_is_refused(text_ckpt):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=text_ckpt, dtype="float32", num_kv_blocks=64))
    try:
        with TestClient(build_app(llm, ServerConfig(shutdown_engine=False))) as c:
            r = c.post("/v1/video/sessions", json={})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            assert "takes no video" in r.json()["error"]["message"]
    finally:
        llm.shutdown()


def test_api_key_guards_the_socket(engine):
    with TestClient(build_app(engine, ServerConfig(shutdown_engine=False, api_key="k3y"))) as c:
        assert c.post("/v1/video/sessions", json={}).status_code == 401
        auth = {"Authorization": "Bearer k3y"}
        path = f"/v1/video/sessions/{c.post('/v1/video/sessions', json={}, headers=auth).json()['id']}"
        for refused_path in (path, path + "?api_key=bad"):
            with pytest.raises(WebSocketDisconnect) as refused, c.websocket_connect(refused_path) as ws:
                ws.receive_json()
            assert refused.value.code == 1008
        for url, headers in [(path + "?api_key=k3y", {}), (path, auth)]:  # a browser can send the first
            with c.websocket_connect(url, headers=headers) as ws:
                assert ws.receive_json()["type"] == "session.ready"
        c.delete(path, headers=auth)


def _metric(http, name: str) -> float:
    lines = http.get("/metrics").text.splitlines()
    return next(float(line.rpartition(" ")[2]) for line in lines if line.rpartition(" ")[0] == name)


def _wait_metric(http, name: str, value: float, timeout: float = 20.0) -> None:
    """Poll /metrics until `name` reads `value` (the engine process reports its counters after each message)."""
    deadline = time.monotonic() + timeout
    while _metric(http, name) != value:
        assert time.monotonic() < deadline, f"{name} is {_metric(http, name)}, not {value}, after {timeout}s"
        time.sleep(0.05)


@pytest.mark.slow
def test_real_server_with_engine_process(ckpt, offline, repo_root):
    """`vlserve serve` (the engine in its own process) and a `websockets` client: the answer equals the offline
    session's, and DELETE empties the engine process's encoder cache and session media store (the eviction is a
    control call there)."""
    import httpx
    from websockets.sync.client import connect

    from tests.api.conftest import serve_subprocess

    frames = _frames(4, seed=8)
    args = f"{ckpt} --dtype float32 --num-kv-blocks 256 --max-model-len 1024 --max-video-sessions 1".split()
    with serve_subprocess(args, repo_root) as base, httpx.Client(base_url=base, timeout=60, trust_env=False) as http:
        session = http.post("/v1/video/sessions", json={"fps": FPS}).json()
        assert http.post("/v1/video/sessions", json={}).status_code == 429  # --max-video-sessions 1
        with connect(f"{base.replace('http', 'ws', 1)}/v1/video/sessions/{session['id']}") as ws:
            assert json.loads(ws.recv())["type"] == "session.ready"
            for frame in frames:
                ws.send(_png(frame))
                assert json.loads(ws.recv())["type"] == "frames.appended"
            ws.send(json.dumps({"type": "question", "question": QUESTION, "max_tokens": 8, "temperature": 0}))
            messages = []
            while not messages or messages[-1]["type"] != "answer.done":
                messages.append(json.loads(ws.recv()))
        done = messages[-1]
        assert done["text"] == _offline_answer(offline, frames).outputs[0].text
        assert "".join(m["delta"] for m in messages if m["type"] == "answer.delta") == done["text"]
        assert _metric(http, "vlserve:encoder_cache_usage") > 0
        assert _metric(http, "vlserve:session_media_items") == 2  # the engine's copy of the window's pairs
        assert http.delete(f"/v1/video/sessions/{session['id']}").status_code == 200
        _wait_metric(http, "vlserve:encoder_cache_usage", 0.0)
        _wait_metric(http, "vlserve:session_media_items", 0.0)
        _wait_metric(http, "vlserve:kv_cache_usage", 0.0)


def test_session_engine_from_another_thread(client, offline):
    """`AsyncSessionEngine` is a whole `SessionEngine`: the blocking `VideoSession.append` / `ask`, called from a
    thread other than the server's loop, run their requests on that loop."""
    session = _open(client)
    wrapped = client.app.state.video_sessions.open[session["id"]]
    frames = _frames(4, seed=12)
    wrapped.session.append(list(frames))
    answer = wrapped.session.ask(QUESTION, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    ref = _offline_answer(offline, frames)
    assert answer.outputs[0].token_ids == ref.outputs[0].token_ids
    assert answer.prompt_token_ids == ref.prompt_token_ids
    assert client.delete(f"/v1/video/sessions/{session['id']}").status_code == 200
