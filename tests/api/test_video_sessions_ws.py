"""Live video sessions over HTTP (vlserve/api/video_sessions.py) on a tiny Qwen2-VL: the REST routes, the
WebSocket protocol, and the engine-side effects (KV blocks, encoder cache) of closing a session.

The oracle: an answer over the WebSocket after N frames equals (greedy) the offline `LLM.open_video_session`'s
answer after the same frames, which equals one ordinary request carrying them (tests/multimodal/test_video_session).
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from tests.support.chat_templates import QWEN2_VL_CHAT_TEMPLATE
from vlserve import LLM, SamplingParams
from vlserve.config import EngineArgs

FPS = 2.0
QUESTION = "What moves?"
ENGINE_KW = dict(dtype="float32", num_kv_blocks=256, block_size=16, max_model_len=1024, max_video_sessions=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("ws_qwen2_vl")), chat_template=QWEN2_VL_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def engine(ckpt):
    from vlserve.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(EngineArgs(model=ckpt, **ENGINE_KW))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    from vlserve.api.server import ServerConfig, build_app

    with TestClient(build_app(engine, ServerConfig(shutdown_engine=False))) as c:
        yield c


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, **ENGINE_KW)


def _frames(n: int, seed: int = 0) -> np.ndarray:
    """[n, 32, 64, 3] uint8: a bright square moving over noise."""
    rng = np.random.RandomState(seed)
    frames = rng.randint(0, 120, (n, 32, 64, 3), dtype=np.uint8)
    for i in range(n):
        x = (7 * i) % 50
        frames[i, 10:24, x : x + 14] = 255
    return frames


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
    before = []
    while True:
        msg = ws.receive_json()
        if msg["type"] == kind:
            return msg, before
        before.append(msg)


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
        assert done["text"] == _offline_answer(offline, frames).outputs[0].text and done["frames"] == 5
    info = client.get(f"/v1/video/sessions/{session['id']}").json()
    assert info["frames"] == 5 and info["window_frames"] == 5  # the session outlives its connection
    assert client.delete(f"/v1/video/sessions/{session['id']}").json() == {
        "id": session["id"],
        "object": "video.session.deleted",
        "deleted": True,
    }
