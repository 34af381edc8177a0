"""What the server-process tests of tests/kv_transfer share: a tiny server's flags, the P2P producer / consumer /
plain server / proxy stack, requests, and /metrics readings."""

from __future__ import annotations

import contextlib
import json
import os

import httpx

from tests.api.conftest import serve_subprocess

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mooncake_site() -> tuple[str, ...]:
    """Extra import paths for the servers (VLSERVE_MOONCAKE_SITE, when set)."""
    return tuple(p for p in [os.environ.get("VLSERVE_MOONCAKE_SITE")] if p)


def serve_args(model_dir, role=None, num_blocks: int = 64, **extra) -> list[str]:
    """`vlserve serve` flags for a tiny float32 server named "tiny"; with `role`, a P2P connector in that role
    (`extra`: its kv_connector_extra_config)."""
    args = [
        str(model_dir),
        "--dtype",
        "float32",
        "--num-kv-blocks",
        str(num_blocks),
        "--max-model-len",
        "256",
        "--block-size",
        "4",
        "--served-model-name",
        "tiny",
        "--log-level",
        "warning",
    ]
    if role is not None:
        args += [
            "--kv-transfer-config",
            json.dumps({"kv_connector": "P2PConnector", "kv_role": role, "kv_connector_extra_config": extra}),
        ]
    return args


@contextlib.contextmanager
def p2p_stack(model_dir, consumer_args: tuple[str, ...] = ()):
    """A P2P producer, a P2P consumer (plus `consumer_args`), a plain server and `vlserve proxy` over the first two:
    yields their base URLs (prod, cons, plain, proxy)."""
    site = mooncake_site()
    with contextlib.ExitStack() as es:
        prod = es.enter_context(
            serve_subprocess(serve_args(model_dir, "kv_producer"), REPO_ROOT, 240, extra_paths=site)
        )
        cons = es.enter_context(
            serve_subprocess(
                serve_args(model_dir, "kv_consumer") + list(consumer_args), REPO_ROOT, 240, extra_paths=site
            )
        )
        plain = es.enter_context(serve_subprocess(serve_args(model_dir), REPO_ROOT, 240))
        proxy = es.enter_context(
            serve_subprocess(
                ["--prefill", prod, "--decode", cons, "--log-level", "warning"], REPO_ROOT, 60, command="proxy"
            )
        )
        yield prod, cons, plain, proxy


def post(base, path, body, status=200):
    """POST `body` as JSON; assert the status; the JSON answer."""
    r = httpx.post(f"{base}{path}", json=body, timeout=120, trust_env=False)
    assert r.status_code == status, r.text
    return r.json()


def metric(base, name) -> float:
    """One sample of the server's /metrics (the first line of that name)."""
    for line in httpx.get(f"{base}/metrics", trust_env=False).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on {base}/metrics")


def streamed_chat(base, body) -> str:
    """The text of a streamed chat completion of `body`."""
    text = ""
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120, trust_env=False
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    return text
