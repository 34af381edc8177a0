"""A real uvicorn server on 127.0.0.1 (free port, background thread) serving tiny random checkpoints."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

TEXT_ENGINE_KW = dict(
    dtype="float32", max_model_len=1024, num_kv_blocks=256, block_size=16, max_num_seqs=64, max_num_batched_tokens=512
)


class ServerThread:
    """uvicorn.Server running `app` in a daemon thread on a kernel-chosen loopback port."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class Served:
    """A running server plus handles the tests use."""

    def __init__(self, engine, thread: ServerThread, model: str):
        import openai

        self.engine = engine
        self.thread = thread
        self.base_url = thread.base_url
        self.model = model
        self.client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=self.base_url, timeout=120, trust_env=False)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics as {name: value}."""
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metrics_labelled(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{labels}': value}."""
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and no KV block is held (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (
                m["vlserve:num_requests_running"] == 0
                and m["vlserve:num_requests_waiting"] == 0
                and m["vlserve:kv_cache_usage"] == 0
            ):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {m}")
            time.sleep(0.05)

    def close(self) -> None:
        self.client.close()
        self.http.close()
        self.thread.stop()
        self.engine.shutdown()


def start_server(engine_args, **config_kw) -> Served:
    from vlserve.api.server import ServerConfig, build_app
    from vlserve.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(engine_args)
    config = ServerConfig(shutdown_engine=False, **config_kw)
    app = build_app(engine, config)
    thread = ServerThread(app).start()
    return Served(engine, thread, app.state.models.names[0])


@pytest.fixture(scope="session")
def text_ckpt(tmp_path_factory) -> str:
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("api_text")), arch="qwen2")


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory) -> str:
    """The directory the servers allow file:// media from."""
    return str(tmp_path_factory.mktemp("allowed_media"))


@pytest.fixture(scope="session")
def server(text_ckpt, media_dir):
    """The text-model server shared by most tests."""
    from vlserve.config import EngineArgs

    served = start_server(
        EngineArgs(model=text_ckpt, served_model_name="tiny-text", **TEXT_ENGINE_KW),
        served_model_names=["tiny-text", "alias"],
    )
    yield served
    served.close()


@pytest.fixture(scope="session")
def offline_llm(text_ckpt):
    """The offline LLM on the same checkpoint: the reference for the server's greedy text."""
    from vlserve import LLM

    return LLM(text_ckpt, **TEXT_ENGINE_KW)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_file_server(files: dict[str, bytes], answer_first=None):
    """A threaded http.server on 127.0.0.1 answering GET `path` with `files[path]` (404 for others); yields its
    base URL. `answer_first(handler) -> bool`, when given, sees each GET first and returns True if it answered."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if answer_first is not None and answer_first(self):
                return
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()
        srv.server_close()


@contextlib.contextmanager
def serve_subprocess(
    serve_args: list[str],
    repo_root: str,
    timeout: float = 120.0,
    command: str = "serve",
    extra_paths: tuple[str, ...] = (),
    procs: list | None = None,
):
    """`vlserve <command> <serve_args> --host 127.0.0.1 --port <free>` as a subprocess (`extra_paths` appended to its
    PYTHONPATH; its Popen appended to `procs`, for tests that kill it); yields its base URL once /health answers 200
    (AssertionError with its output if it exits first or never does), then stops it."""
    port = free_port()
    cmd = [sys.executable, "-m", "vlserve.cli", command, *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        cwd=repo_root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((repo_root, *extra_paths))},
    )
    if procs is not None:
        procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited early:\n{proc.stdout.read()}")
            try:
                if httpx.get(f"{base}/health", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("server did not become healthy")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="session")
def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
