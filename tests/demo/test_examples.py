"""Every example runs as written (a subprocess, the embedded demo model), the server ones against a server we start."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_example(name: str, *args: str) -> str:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "NO_PROXY": "127.0.0.1,localhost"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def answers(stdout: str) -> dict[str, str]:
    """{question: answer} from the examples' `question -> 'answer'` lines."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^(.*?) -> '(.*?)'", stdout, re.M)}


@pytest.fixture(scope="module")
def demo_server():
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs

    served = start_server(EngineArgs(model=None))
    yield served
    served.close()


def test_offline_batch():
    out = run_example("offline_batch.py")
    got = answers(out)
    assert len(got) == 6 and all(got.values()), out
    assert re.search(r"6 requests, \d+ tokens in [\d.]+ s", out)


def test_video_qa_offline_and_through_the_server(demo_server):
    offline = run_example("video_qa.py")
    assert "encoder cache:" in offline and "rendered" in offline
    online = run_example("video_qa.py", "--base-url", f"{demo_server.base_url}/v1")
    a, b = answers(offline), answers(online)
    assert len(a) == 3 and all(a.values()), offline
    assert a == b, "the server and LLM.chat answer the same clip identically (greedy)"


def test_live_video_session_answers_as_one_request_would():
    out = run_example("live_video.py", "--check")
    asked = re.findall(r"^after +(\d+) frames: .*? -> '(.*?)'", out, re.M)
    assert [n for n, _ in asked] == ["8", "16"] and all(a for _, a in asked), out
    assert out.count("(same: True)") == 2, out  # each answer is the one a request with the window's frames gets


def test_image_chat_openai(demo_server):
    out = run_example("image_chat_openai.py", "--base-url", f"{demo_server.base_url}/v1")
    got = answers(out)
    assert got and all(got.values()), out
    streamed = out.split("streamed: ", 1)[1].strip()
    assert streamed == next(iter(got.values())), "the streamed reply equals the non-streamed one"


def test_image_search_offline_and_through_the_server():
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs

    offline = run_example("image_search.py")
    ranks = re.findall(r"^\d\. ([+-][\d.]+)  picture (\d): (.*)$", offline, re.M)
    assert len(ranks) == 5 and sorted(int(i) for _, i, _ in ranks) == list(range(5)), offline
    assert [float(s) for s, _, _ in ranks] == sorted((float(s) for s, _, _ in ranks), reverse=True)
    served = start_server(EngineArgs(model=None, runner="pooling", convert="embed"))
    try:
        online = run_example("image_search.py", "--server", served.base_url)
    finally:
        served.close()
    online_ranks = re.findall(r"^\d\. ([+-][\d.]+)  picture (\d): (.*)$", online, re.M)
    assert [i for _, i, _ in online_ranks] == [i for _, i, _ in ranks], "/v1/rerank ranks as LLM.score does"
    assert all(abs(float(a) - float(b)) < 1e-3 for (a, _, _), (b, _, _) in zip(online_ranks, ranks))
