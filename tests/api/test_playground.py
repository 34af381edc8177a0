"""The playground page: served at / and /playground (off with --disable-playground, its /v1 calls behind --api-key),
its shipped examples are the demo world's, and, in a real headless Chromium against `vlserve serve` on the demo
model, it streams the API's greedy answer and shows the server's 400 for a corrupt upload.

Screenshots of each browser state go to $VLSERVE_TEST_ARTIFACTS (default: a pytest temp directory). Without Chromium
the browser tests skip, or fail where VLSERVE_REQUIRE_BROWSER=1 (CI sets it after `make browser`).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from tests.api.conftest import TEXT_ENGINE_KW, serve_subprocess

EXAMPLES_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "vlserve", "api", "static", "examples"
)


def _app(engine, **config_kw):
    from vlserve.api.server import ServerConfig, build_app

    return TestClient(build_app(engine, ServerConfig(shutdown_engine=False, **config_kw)))


# ------------------------------------------------------------------------------------------- without a browser
def test_page_served_at_root_and_playground(server):
    client = _app(server.engine)
    for path in ("/", "/playground"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "/playground/static/playground.js" in r.text and "http" not in r.text.split("<body>")[0].lower()
        assert "/playground/static/live.js" in r.text
    for asset, kind in (
        ("playground.js", "javascript"),
        ("live.js", "javascript"),
        ("examples/live_demo.webm", "video/webm"),
        ("playground.css", "text/css"),
        ("examples/img1.png", "image/png"),
    ):
        r = client.get(f"/playground/static/{asset}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    info = client.get("/v1/playground/info").json()
    assert info == {
        "models": ["tiny-text"],
        "modalities": [],
        "demo": False,
        "max_model_len": TEXT_ENGINE_KW["max_model_len"],
    }


def test_disable_playground_gives_404(server):
    client = _app(server.engine, playground=False)
    for path in ("/", "/playground", "/playground/static/playground.js", "/v1/playground/info"):
        assert client.get(path).status_code == 404, path
    assert client.get("/v1/models").status_code == 200


def test_disable_playground_flag():
    from vlserve.cli import build_parser, serve_config_from_args

    _, on = serve_config_from_args(build_parser().parse_args(["serve", "/m"]))
    _, off = serve_config_from_args(build_parser().parse_args(["serve", "/m", "--disable-playground"]))
    assert on.playground is True and off.playground is False


def test_api_key_applies_to_the_page_calls(server):
    client = _app(server.engine, api_key="sekrit")
    assert client.get("/").status_code == 200  # the page itself is public: it asks for the key
    assert client.get("/v1/playground/info").status_code == 401
    ok = client.get("/v1/playground/info", headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200 and ok.json()["models"] == ["tiny-text"]


def test_page_files_load_nothing_from_elsewhere():
    static = os.path.dirname(EXAMPLES_DIR)
    for name in ("playground.html", "playground.js", "live.js", "playground.css"):
        text = open(os.path.join(static, name)).read()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text and "@import" not in text


def test_shipped_examples_are_the_demo_world(tmp_path):
    from training import playground_examples
    from vlserve.demo import world

    entries = playground_examples.write_examples(str(tmp_path))
    assert json.load(open(os.path.join(EXAMPLES_DIR, "examples.json"))) == entries
    for entry, scene in zip(entries, playground_examples.example_scenes()):
        shipped = np.asarray(Image.open(os.path.join(EXAMPLES_DIR, entry["file"])).convert("RGB"))
        assert np.array_equal(shipped, np.asarray(Image.open(tmp_path / entry["file"]).convert("RGB")))
        assert {(q["question"], q["answer"]) for q in entry["questions"]} == {(q, a) for _, q, a in world.qas(scene)}
    clip = entries[-1]
    assert clip["kind"] == "video" and os.path.getsize(os.path.join(EXAMPLES_DIR, clip["file"])) < 50_000


def test_shipped_live_clip_is_the_demo_world(tmp_path):
    """Live mode's looping clip decodes to the demo world's frames (VP8 is lossy: compared within a tolerance)."""
    import av

    from training import playground_examples
    from vlserve.demo import world

    entry = playground_examples.write_live_clip(str(tmp_path))
    assert json.load(open(os.path.join(EXAMPLES_DIR, "live_demo.json"))) == entry
    clip = playground_examples.live_clip()
    assert {(q["question"], q["answer"]) for q in entry["questions"]} == {(q, a) for _, q, a in world.qas(clip)}
    path = os.path.join(EXAMPLES_DIR, entry["file"])
    assert os.path.getsize(path) < 50_000
    with av.open(path) as container:
        assert container.format.name.startswith("matroska") and container.streams.video[0].codec_context.name == "vp8"
        shipped = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    rendered = [np.asarray(frame) for frame in world.render_video(clip)]
    assert len(shipped) == len(rendered) == playground_examples.LIVE_CLIP_FRAMES
    for got, want in zip(shipped, rendered):
        h, w = got.shape[:2]
        assert np.abs(got.astype(int) - want[:h, :w].astype(int)).mean() < 6


# ------------------------------------------------------------------------------------------------ in Chromium
@pytest.fixture(scope="module")
def chromium():
    from tests.support.browser import find_chromium

    found = find_chromium()
    if isinstance(found, str):
        if os.environ.get("VLSERVE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"VLSERVE_REQUIRE_BROWSER=1 but {found}")
        pytest.skip(found)
    return found


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> str:
    out = os.environ.get("VLSERVE_TEST_ARTIFACTS") or str(tmp_path_factory.mktemp("playground_artifacts"))
    os.makedirs(out, exist_ok=True)
    return out


API_KEY = "playground-key"


@pytest.fixture(scope="module")
def demo_server(chromium, repo_root):
    """`vlserve serve` on the demo model with --api-key, as a subprocess on a free port (small KV: quick start)."""
    from vlserve.demo import default_model_path

    args = [
        default_model_path(),
        "--served-model-name",
        "vlserve-demo",
        "--api-key",
        API_KEY,
        "--num-kv-blocks",
        "128",
        "--max-num-seqs",
        "4",
        "--log-level",
        "warning",
    ]
    with serve_subprocess(args, repo_root) as base:
        yield base


@pytest.fixture(scope="module")
def api(demo_server):
    """An HTTP client for the reference requests (with the server's key)."""
    with httpx.Client(
        base_url=demo_server, timeout=120, trust_env=False, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as client:
        yield client


@pytest.fixture(scope="module")
def browser(chromium, tmp_path_factory):
    from tests.support.browser import headless_chromium

    driver = headless_chromium(*chromium, str(tmp_path_factory.mktemp("chromium_profile")))
    yield driver
    driver.quit()


def _wait(driver, condition, what: str, timeout: float = 60):
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    # the page re-renders lists (chips, examples) while we read them: an element found a moment ago can be gone,
    # which only means "not there yet", so poll again
    try:
        return WebDriverWait(
            driver, timeout, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)
        ).until(condition)
    except TimeoutException:
        console = [entry["message"] for entry in driver.get_log("browser")]
        raise AssertionError(f"timed out waiting for {what}; browser console: {console}") from None


def _open_page(driver, base: str) -> None:
    """Load the page; the first time in this tab it asks for the API key (then the tab keeps it)."""
    from selenium.webdriver.common.by import By

    driver.get(base + "/")
    ready = _wait(
        driver,
        lambda d: (
            ("key" if d.find_element(By.ID, "key-input").is_displayed() else None)
            or ("page" if d.find_elements(By.CSS_SELECTOR, "#model option") else None)
        ),
        "the page or key prompt",
    )
    if ready == "key":
        driver.find_element(By.ID, "key-input").send_keys(API_KEY + "\n")
    _wait(
        driver,
        lambda d: d.find_element(By.ID, "demo").is_displayed() and d.find_elements(By.CSS_SELECTOR, "#model option"),
        "the demo panel and the model list",
    )


def _ask(driver, question: str, upload: str | None = None) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    if upload is not None:
        driver.find_element(By.ID, "file").send_keys(upload)
        _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#attachments .attachment"), "the attachment")
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(question)
    box.send_keys(Keys.ENTER)  # the keyboard path: Enter sends


def _data_url(path: str, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(open(path, "rb").read()).decode()


@pytest.mark.slow
def test_browser_streams_the_greedy_answer(browser, demo_server, api, repo_root, artifacts):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    image = os.path.join(repo_root, "docs", "demo_image.png")
    _open_page(browser, demo_server)  # asks for the key first: every /v1 call below carries it
    _ask(browser, "Describe the image.", upload=image)
    done = "#conversation .turn.assistant[data-state=done]"
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, done)) == 1, "the streamed answer")
    browser.save_screenshot(os.path.join(artifacts, "playground_answered.png"))

    max_tokens = int(browser.find_element(By.ID, "max-tokens").get_attribute("value"))
    user = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": _data_url(image)}},
            {"type": "text", "text": "Describe the image."},
        ],
    }
    request = {"model": "vlserve-demo", "messages": [user], "temperature": 0, "max_tokens": max_tokens}
    greedy = api.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]["content"]
    answer = browser.find_element(By.CSS_SELECTOR, f"{done} .text").text
    assert answer == greedy and answer.startswith("The image shows")
    figures = browser.find_element(By.CSS_SELECTOR, f"{done} .figures").text
    assert "TTFT" in figures and "tokens/s" in figures and "cached" in figures, figures

    # a second turn: the conversation (image included) goes again, and its prefix comes from the cache
    _ask(browser, "How many shapes are there?")
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, done)) == 2, "the second answer")
    second = api.post(
        "/v1/chat/completions",
        json={
            **request,
            "messages": [
                user,
                {"role": "assistant", "content": greedy},
                {"role": "user", "content": "How many shapes are there?"},
            ],
        },
    )
    turns = browser.find_elements(By.CSS_SELECTOR, done)
    assert turns[1].find_element(By.CSS_SELECTOR, ".text").text == second.json()["choices"][0]["message"]["content"]
    cached = turns[1].find_element(By.CSS_SELECTOR, ".figures").text.rsplit(", ", 1)[1]
    assert cached.endswith(" cached") and int(cached.split()[0]) > 0, cached
    browser.save_screenshot(os.path.join(artifacts, "playground_two_turns.png"))

    # "Copy as curl" holds the last request, ready to run (the key by name, not by value)
    browser.find_element(By.ID, "copy-curl").click()
    code = _wait(browser, lambda d: d.find_element(By.ID, "copy-text").get_attribute("value"), "the curl text")
    assert "$VLSERVE_API_KEY" in code and API_KEY not in code
    body = json.loads(code.split("<<'JSON'\n", 1)[1].rsplit("\nJSON", 1)[0])
    assert body["messages"][0] == user and body["messages"][2]["content"] == "How many shapes are there?"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    browser.save_screenshot(os.path.join(artifacts, "playground_copy_curl.png"))

    # "Copy as Python" (Escape closes the dialog first) runs as it is and streams the same second answer
    browser.switch_to.active_element.send_keys(Keys.ESCAPE)
    _wait(browser, lambda d: not d.find_element(By.ID, "copy-dialog").is_displayed(), "the dialog to close")
    browser.find_element(By.ID, "copy-python").click()
    script = _wait(
        browser,
        lambda d: (
            "OpenAI(" in (d.find_element(By.ID, "copy-text").get_attribute("value") or "")
            and d.find_element(By.ID, "copy-text").get_attribute("value")
        ),
        "the Python text",
    )
    ran = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VLSERVE_API_KEY": API_KEY, "NO_PROXY": "127.0.0.1"},
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.startswith(second.json()["choices"][0]["message"]["content"] + "\n"), ran.stdout


@pytest.mark.slow
def test_browser_shows_the_servers_400_for_a_corrupt_upload(browser, demo_server, api, tmp_path, artifacts):
    from selenium.webdriver.common.by import By

    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"this is not a picture" * 8)
    _open_page(browser, demo_server)
    _ask(browser, "Describe the image.", upload=str(corrupt))
    error = _wait(
        browser,
        lambda d: d.find_element(By.ID, "error").is_displayed() and d.find_element(By.ID, "error"),
        "the error message",
    )
    browser.save_screenshot(os.path.join(artifacts, "playground_error.png"))

    request = {
        "model": "vlserve-demo",
        "max_tokens": 8,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(str(corrupt))}},
                    {"type": "text", "text": "Describe the image."},
                ],
            }
        ],
    }
    r = api.post("/v1/chat/completions", json=request)
    assert r.status_code == 400
    assert error.text == f"Error 400: {r.json()['error']['message']}"
    # the failed turn is taken back: question and upload wait in the composer for another try
    assert browser.find_elements(By.CSS_SELECTOR, "#conversation .turn") == []
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "Describe the image."
    assert len(browser.find_elements(By.CSS_SELECTOR, "#attachments .attachment")) == 1


@pytest.mark.slow
def test_browser_phone_width_example_and_chip(browser, demo_server, artifacts):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    example = json.load(open(os.path.join(EXAMPLES_DIR, "examples.json")))[0]
    browser.set_window_size(390, 844)
    try:
        _open_page(browser, demo_server)
        # the examples arrive by a fetch of their own, after the demo panel shows: wait for them
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#examples button"), "the examples")[0].click()
        _wait(
            browser,
            lambda d: (
                [c.text for c in d.find_elements(By.CSS_SELECTOR, "#chips button")]
                == [q["question"] for q in example["questions"]]
            ),
            "the example's questions as chips",
        )
        qa = example["questions"][0]
        # a re-render between finding the chip and clicking it makes it stale: find and click again
        _wait(
            browser,
            lambda d: d.find_element(By.XPATH, f"//div[@id='chips']/button[text()='{qa['question']}']").click() or True,
            "a click on the question's chip",
        )
        _wait(
            browser,
            lambda d: d.find_element(By.ID, "prompt").get_attribute("value") == qa["question"],
            "the chip's question in the box",
        )
        browser.find_element(By.ID, "prompt").send_keys(Keys.ENTER)
        expected = _wait(
            browser,
            lambda d: d.find_elements(By.CSS_SELECTOR, ".turn.assistant .expected"),
            "the world's answer beside the model's",
        )
        assert expected[0].text.endswith(f"the world's answer: {qa['answer']}")
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        browser.save_screenshot(os.path.join(artifacts, "playground_phone.png"))
    finally:
        browser.set_window_size(1100, 760)
