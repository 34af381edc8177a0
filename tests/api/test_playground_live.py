"""The playground's live mode in a real headless Chromium against `vlserve serve` on the demo model (a Qwen2-VL):
the page streams the looping demo clip, or Chromium's fake camera, to a video session over its WebSocket as JPEG
frames, asks the question every few seconds, shows each answer as the server sent it (read from the DevTools log of
the socket's frames), and deletes the session when it leaves live mode.

Screenshots go to $VLSERVE_TEST_ARTIFACTS (default: a pytest temp directory). Without Chromium the tests skip, or
fail where VLSERVE_REQUIRE_BROWSER=1.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os

import pytest
from PIL import Image

from tests.api.conftest import serve_subprocess
from tests.api.test_playground import (  # noqa: F401  (chromium, artifacts, api: fixtures shared with the chat tests)
    API_KEY,
    EXAMPLES_DIR,
    _open_page,
    _wait,
    api,
    artifacts,
    chromium,
)

LIVE_CLIP = json.load(open(os.path.join(EXAMPLES_DIR, "live_demo.json")))


@pytest.fixture(scope="module")
def demo_server(chromium, repo_root):
    """`vlserve serve` on the demo model with --api-key (the socket then takes it as ?api_key=)."""
    from vlserve.demo import default_model_path

    args = [
        default_model_path(),
        "--served-model-name",
        "vlserve-demo",
        "--api-key",
        API_KEY,
        "--num-kv-blocks",
        "256",
        "--max-num-seqs",
        "4",
        "--log-level",
        "warning",
    ]
    with serve_subprocess(args, repo_root) as base:
        yield base


@pytest.fixture(scope="module")
def browser(chromium, tmp_path_factory):
    """Chromium with a fake camera (a moving test pattern, no permission prompt) and the network log kept."""
    from tests.support.browser import FAKE_CAMERA_FLAGS, headless_chromium

    profile = str(tmp_path_factory.mktemp("chromium_live_profile"))
    driver = headless_chromium(*chromium, profile, extra_flags=FAKE_CAMERA_FLAGS, network_log=True)
    yield driver
    driver.quit()


class SocketLog:
    """The WebSocket traffic of the page, from the DevTools network events in the driver's performance log."""

    def __init__(self, driver):
        self.driver = driver
        self.urls: list[str] = []
        self.received: list[dict] = []  # JSON messages from the server
        self.sent_text: list[dict] = []  # JSON messages from the page
        self.sent_binary: list[bytes] = []

    def read(self) -> SocketLog:
        for entry in self.driver.get_log("performance"):  # drains the log: keep what it held
            event = json.loads(entry["message"])["message"]
            method, params = event["method"], event.get("params", {})
            if method == "Network.webSocketCreated":
                self.urls.append(params["url"])
            elif method in ("Network.webSocketFrameReceived", "Network.webSocketFrameSent"):
                frame = params["response"]
                if frame["opcode"] == 2:
                    self.sent_binary.append(base64.b64decode(frame["payloadData"]))
                elif frame["opcode"] == 1:
                    message = json.loads(frame["payloadData"])
                    (self.received if method.endswith("Received") else self.sent_text).append(message)
        return self

    def done(self) -> dict[str, dict]:
        return {m["question_id"]: m for m in self.received if m["type"] == "answer.done"}

    def deltas(self, question_id: str) -> str:
        return "".join(m["delta"] for m in self.received if m.get("question_id") == question_id and "delta" in m)


def _run_live(driver, base: str, source: str, question: str) -> SocketLog:
    """Open the page, switch to live mode with `source`, start asking `question` every 2 s, and wait for two
    answers."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get_log("performance")  # what earlier tests left
    _open_page(driver, base)
    _wait(driver, lambda d: d.find_element(By.ID, "mode-live").is_displayed(), "the Live button")
    driver.find_element(By.ID, "mode-live").click()
    Select(driver.find_element(By.ID, "live-source")).select_by_value(source)
    for field, value in (("live-interval", "2"), ("live-question", question)):
        driver.find_element(By.ID, field).clear()
        driver.find_element(By.ID, field).send_keys(value)
    driver.find_element(By.ID, "live-start").click()
    done = ".live-answer[data-state=done]"
    _wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, done)) >= 2, "two live answers", timeout=240)
    return SocketLog(driver).read()


def _check_answers_are_the_servers(driver, log: SocketLog, question: str) -> list[str]:
    """Every finished answer on the page is the text of the server's answer.done for its question id, with its
    TTFT and frame count; returns the texts."""
    from selenium.webdriver.common.by import By

    server = log.done()
    texts = []
    for entry in driver.find_elements(By.CSS_SELECTOR, ".live-answer[data-state=done]"):
        sent = server[entry.get_attribute("data-question-id")]
        text = entry.find_element(By.CSS_SELECTOR, ".text").text
        assert text == sent["text"] and text and log.deltas(sent["question_id"]) == text
        figures = entry.find_element(By.CSS_SELECTOR, ".figures").text  # (JS rounds halves up)
        assert f"TTFT {math.floor(sent['ttft_ms'] + 0.5)} ms" in figures and f"{sent['frames']} frames" in figures, (
            figures
        )
        assert entry.find_element(By.CSS_SELECTOR, ".when").text.endswith(question)
        texts.append(text)
    asked = [m for m in log.sent_text if m["type"] == "question"]
    assert len(asked) >= 2 and {m["question"] for m in asked} == {question}
    assert {(m["max_tokens"], m["temperature"]) for m in asked} == {(128, 0)}  # the header's settings
    assert len({m["question_id"] for m in asked}) == len(asked)
    return texts


def _frame_sizes(log: SocketLog) -> set[tuple[int, int]]:
    """The sizes of the frames the page sent, each a whole JPEG."""
    sizes = set()
    for data in log.sent_binary:
        image = Image.open(io.BytesIO(data))
        image.load()
        assert image.format == "JPEG"
        sizes.add(image.size)
    return sizes


def _session_id(log: SocketLog) -> str:
    """The id of the one session the page opened, from its socket's URL (which carries the key)."""
    (url,) = log.urls
    assert url.endswith(f"?api_key={API_KEY}")
    return url.split("/v1/video/sessions/", 1)[1].split("?", 1)[0]


def _leaving_deletes_the_session(driver, api, log: SocketLog, leave_page: bool = False) -> None:
    """Back to chat mode (or, with `leave_page`, to another page): the page deletes its session."""
    from selenium.webdriver.common.by import By

    session_id = _session_id(log)
    assert api.get(f"/v1/video/sessions/{session_id}").status_code == 200
    if leave_page:
        driver.get("about:blank")
    else:
        driver.find_element(By.ID, "mode-chat").click()
        assert driver.find_element(By.ID, "composer").is_displayed()
    _wait(
        driver,
        lambda d: api.get(f"/v1/video/sessions/{session_id}").status_code == 404,
        "the session to be deleted",
    )


@pytest.mark.slow
def test_browser_live_demo_clip(browser, demo_server, api, artifacts):
    from selenium.webdriver.common.by import By

    qa = next(q for q in LIVE_CLIP["questions"] if q["form"] == "direction")
    log = _run_live(browser, demo_server, "demo", qa["question"])
    browser.save_screenshot(os.path.join(artifacts, "playground_live_clip.png"))
    _check_answers_are_the_servers(browser, log, qa["question"])
    # the clip's frames at its own size (under the page's 640-px cap), one size for the whole session
    import av

    with av.open(os.path.join(EXAMPLES_DIR, LIVE_CLIP["file"])) as clip:
        clip_size = (clip.streams.video[0].codec_context.width, clip.streams.video[0].codec_context.height)
    assert _frame_sizes(log) == {clip_size}
    chips = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "#live-chips button")]
    assert chips == [q["question"] for q in LIVE_CLIP["questions"]]
    # the clip is the demo world's: each answer is checked against the world's answer
    for entry in browser.find_elements(By.CSS_SELECTOR, ".live-answer[data-state=done]"):
        text = entry.find_element(By.CSS_SELECTOR, ".text").text
        verdict = "\u2713 matches" if text == qa["answer"] else "\u2717 differs from"
        assert entry.find_element(By.CSS_SELECTOR, ".expected").text == f"{verdict} the clip's answer: {qa['answer']}"

    # the session has the page's settings: 2 frames/s, a window of 8 s
    session_id = _session_id(log)
    session = api.get(f"/v1/video/sessions/{session_id}").json()
    assert session["fps"] == 2.0 and session["max_frames"] == 16 and session["frames"] >= 4, session

    # a question the server refuses (max_tokens 0): its error shows, on the page and in its place in the list
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("0")
    failed = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".live-answer[data-state=error]"), "an error")[0]
    errors = [m for m in log.read().received if m["type"] == "error"]
    assert [e["question_id"] for e in errors] == [failed.get_attribute("data-question-id")]
    message = errors[0]["error"]["message"]
    assert "max_tokens" in message and failed.find_element(By.CSS_SELECTOR, ".text").text == message
    assert browser.find_element(By.ID, "error").text == f"Error 400: {message}"
    browser.save_screenshot(os.path.join(artifacts, "playground_live_error.png"))
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("128")
    _leaving_deletes_the_session(browser, api, log)


@pytest.mark.slow
def test_browser_live_fake_camera_at_phone_width(browser, demo_server, api, artifacts):
    question = "Describe the video."
    browser.set_window_size(390, 844)
    try:
        log = _run_live(browser, demo_server, "webcam", question)
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        browser.save_screenshot(os.path.join(artifacts, "playground_live_camera_phone.png"))
    finally:
        browser.set_window_size(1100, 760)
    _check_answers_are_the_servers(browser, log, question)
    assert _frame_sizes(log) == {(640, 480)}  # Chromium's fake camera is 640x480, under the page's cap
    _leaving_deletes_the_session(browser, api, log, leave_page=True)
