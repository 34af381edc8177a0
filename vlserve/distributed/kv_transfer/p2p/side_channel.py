"""The producer worker's side channel (plain TCP, one JSON line each way): a consumer asks how to address the
producer's cache (`describe`: the transfer engine's session, each tensor's base and bytes per block) and says when it
is done reading a request's blocks (`done`), which lets the producer free them. No torch, no Mooncake."""

from __future__ import annotations

import json
import socket
import socketserver
import threading


class SideChannelServer:
    def __init__(self, host: str, port: int, describe, on_done):
        describe_fn, done_fn = describe, on_done

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                for line in self.rfile:
                    msg = json.loads(line)
                    if msg.get("op") == "describe":
                        reply = {"ok": True, "cache": describe_fn()}
                    elif msg.get("op") == "done":
                        done_fn(str(msg["request_id"]))
                        reply = {"ok": True}
                    else:
                        reply = {"ok": False, "error": f"unknown op {msg.get('op')!r}"}
                    self.wfile.write((json.dumps(reply) + "\n").encode())

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self.server = Server((host, port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="kv-side-channel", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def ask(host: str, port: int, msg: dict, timeout: float = 10.0) -> dict:
    """One request-reply with a producer's side channel (OSError / ValueError when it fails)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall((json.dumps(msg) + "\n").encode())
        reply = s.makefile("rb").readline()
    out = json.loads(reply)
    if not out.get("ok"):
        raise ValueError(f"side channel {host}:{port}: {out.get('error')}")
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
