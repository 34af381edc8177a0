"""The demo server's memory: start `make serve`'s command (`python -m vlserve.quickstart -- --port P [flags]`),
send the README's image chat, and print the RSS of every process in the server's tree (from /proc) after start-up
and after the request.

    .venv/bin/python -m benchmarks.serve_memory [--port 8021] [-- extra `vlserve serve` flags, e.g. --engine-process]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(c) for c in f.read().split()]
    return kids


def tree_rss(root: int) -> list[tuple[int, float, str]]:
    """(pid, RSS MiB, command line) of `root` and its descendants."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()[:90]
            out.append((pid, _rss_mib(pid), cmd))
            todo += _children(pid)
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue  # ended meanwhile
    return out


def show(tag: str, root: int) -> None:
    rows = tree_rss(root)
    print(f"--- {tag}: {len(rows)} process(es), total RSS {sum(r for _, r, _ in rows):.0f} MiB")
    for pid, rss, cmd in rows:
        print(f"  {pid:>7}  {rss:6.0f} MiB  {cmd}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8021)
    parser.add_argument("serve_args", nargs="*", help="extra `vlserve serve` flags (after --)")
    args = parser.parse_args()
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlserve.quickstart", "--", "--port", str(args.port), *args.serve_args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.time() - t0 > 300:
                    sys.exit(f"the server did not start; its log: {log.name}")
                time.sleep(0.5)
        time.sleep(2)
        show("after start-up", proc.pid)
        with open(os.path.join(ROOT, "docs", "demo_image.png"), "rb") as f:
            image = "data:image/png;base64," + base64.b64encode(f.read()).decode()
        body = {
            "model": "vlserve-demo",
            "max_tokens": 48,
            "temperature": 0,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": image}},
                        {"type": "text", "text": "Describe the image."},
                    ],
                }
            ],
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{args.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        print(json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["message"]["content"])
        time.sleep(2)
        show("after one image chat request", proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


if __name__ == "__main__":
    main()
