"""A live video session over a WebSocket: frames of a moving shape go to a running `vlserve serve` (the demo model
by default) one binary message each, and a question is asked at two moments; each answer streams back.

vlserve serve                                   # in another shell (the demo model)
python examples/live_video_ws.py                # the shape moves right, then turns and moves down
"""

import argparse
import asyncio
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from live_video import QUESTION, moving_shape_frames  # noqa: E402


async def run(base_url: str, window: int, api_key: str | None) -> None:
    import httpx
    import websockets

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, trust_env=False) as http:
        session = (await http.post("/v1/video/sessions", json={"fps": 2, "max_frames": window})).json()
    url = f"{base_url.replace('http', 'ws', 1)}/v1/video/sessions/{session['id']}"
    frames, kind = moving_shape_frames()
    question = QUESTION.format(shape=kind)
    async with websockets.connect(url + (f"?api_key={api_key}" if api_key else "")) as ws:
        assert json.loads(await ws.recv())["type"] == "session.ready"
        for i, frame in enumerate(frames, 1):
            png = io.BytesIO()
            frame.save(png, format="PNG")
            await ws.send(png.getvalue())  # a binary message: one encoded frame
            assert json.loads(await ws.recv())["type"] == "frames.appended"
            if i in (window, len(frames)):
                ask = {"type": "question", "question": question, "max_tokens": 24, "temperature": 0}
                await ws.send(json.dumps(ask))
                while (msg := json.loads(await ws.recv()))["type"] != "answer.done":
                    assert msg["type"] == "answer.delta", msg  # the answer's text, as it is generated
                print(f"after {i:2d} frames: {question} -> {msg['text']!r} (first token after {msg['ttft_ms']} ms)")
        await ws.send(json.dumps({"type": "session.close"}))
        print(json.loads(await ws.recv()))  # session.closed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--window", type=int, default=8, help="frames a question sees (max_frames)")
    parser.add_argument("--api-key", default=None, help="the server's --api-key")
    args = parser.parse_args()
    asyncio.run(run(args.base_url, args.window, args.api_key))


if __name__ == "__main__":
    main()
