"""`EngineCoreClient`: the API process's end of N engine-core processes (spawn, pyzmq sockets, handshake).

N is `data_parallel_size` (1 unless data-parallel replicas are asked for). Sockets, bound by the client on ipc://
paths in a private temporary directory: a PUSH socket per engine (its input) and one PULL socket all engines push
to (messages carry `engine_index`). After the handshake a receiver thread owns the PULL socket: it hands each
decoded message to a callback and, when any engine process exits, hands an `EngineGone` for it instead.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vlserve.config import EngineArgs
from vlserve.engine.core_messages import EngineFailed, EngineReady, ShutdownEngine, decode, encode
from vlserve.engine.core_proc import run_engine_core

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT = 600.0  # seconds for the engine process to load its model and say ready
_POLL_MS = 200


class EngineStartupError(RuntimeError):
    """The engine process did not come up: it reported an error, exited, or stayed silent past the timeout."""


@dataclass
class EngineGone:
    """Posted by the receiver thread once the engine process has exited (the exit code, when known)."""

    engine_index: int
    exitcode: int | None


class EngineCoreClient:
    """Starts `engine_args.data_parallel_size` engine-core processes and talks to them; `spawn()` then
    `wait_ready()` (which raises if any fails to come up)."""

    def __init__(self, engine_args: EngineArgs, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT):
        import zmq

        self.engine_args = engine_args
        self.num_engines = engine_args.data_parallel_size
        self.startup_timeout = startup_timeout
        self._dir = tempfile.mkdtemp(prefix="vlserve-engine-")
        self.input_addresses = [f"ipc://{self._dir}/input-{i}" for i in range(self.num_engines)]
        self.output_address = f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._inputs = []
        for address in self.input_addresses:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            self._inputs.append(sock)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self.output_address)
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.ready: list[EngineReady] = []  # by engine index, once all are ready
        self._receiver: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = False

    # -- start-up ----------------------------------------------------------------------------------------------
    def spawn(self) -> None:
        """Start the engine processes (they begin loading the model); `wait_ready()` then waits for them."""
        ctx = multiprocessing.get_context("spawn")
        for i, address in enumerate(self.input_addresses):
            process = ctx.Process(
                target=run_engine_core,
                name=f"vlserve-engine-{i}",
                args=(self.engine_args, address, self.output_address, i, logging.getLogger().getEffectiveLevel()),
                # an engine that starts rank processes of its own cannot be a daemon; it still
                # exits with this process (it watches its parent) and `close` stops it
                daemon=not self.engine_args.world_size > 1
                and self.engine_args.distributed_executor_backend in (None, "uni"),
            )
            process.start()
            self.processes.append(process)

    def wait_ready(self) -> list[EngineReady]:
        """Block until every engine says ready (their messages by engine index); EngineStartupError (with the
        engine's own error text) if one does not."""
        deadline = time.monotonic() + self.startup_timeout
        ready: dict[int, EngineReady] = {}
        try:
            while len(ready) < self.num_engines:
                if self._output.poll(_POLL_MS):
                    msg = decode(self._output.recv())
                    if isinstance(msg, EngineReady):
                        ready[msg.engine_index] = msg
                    elif isinstance(msg, EngineFailed):
                        raise EngineStartupError(
                            f"the engine process{self._which(msg.engine_index)} failed to start: {msg.error}"
                        )
                    else:
                        logger.warning("unexpected %s before the engine was ready", type(msg).__name__)
                    continue
                dead = [i for i, p in enumerate(self.processes) if not p.is_alive()]
                if dead:
                    raise EngineStartupError(
                        f"the engine process{self._which(dead[0])} exited (code "
                        f"{self.processes[dead[0]].exitcode}) before it was ready; see its "
                        "log above"
                    )
                if time.monotonic() > deadline:
                    raise EngineStartupError(f"the engine process was not ready after {self.startup_timeout:.0f}s")
        except BaseException:
            self.close(kill=True)
            raise
        self.ready = [ready[i] for i in range(self.num_engines)]
        return self.ready

    def _which(self, engine_index: int) -> str:
        """The engine's number for error texts, when there are several engines."""
        return f" {engine_index}" if self.num_engines > 1 else ""

    def start_receiver(self, on_message: Callable[[object], None]) -> None:
        """Hand every later engine message to `on_message` from a daemon thread (and an EngineGone at the end)."""
        self._receiver = threading.Thread(
            target=self._receive_loop, args=(on_message,), name="vlserve-engine-recv", daemon=True
        )
        self._receiver.start()

    def _receive_loop(self, on_message: Callable[[object], None]) -> None:
        next_check = time.monotonic() + _POLL_MS / 1000
        while not self._stopping.is_set():
            try:
                # a busy replica keeps the socket full: look at the processes on time anyway, or a dead replica
                # would go unnoticed until the live ones fall idle
                if self._output.poll(_POLL_MS) and time.monotonic() < next_check:
                    on_message(decode(self._output.recv()))
                    continue
            except Exception:  # sockets closed under us at shutdown
                if self._stopping.is_set():
                    return
                logger.exception("engine receiver failed")
                on_message(EngineGone(0, None))
                return
            next_check = time.monotonic() + _POLL_MS / 1000
            for i, process in enumerate(self.processes):
                if not process.is_alive():
                    if not self._stopping.is_set():
                        self._drain(on_message)  # its last words (e.g. which rank died) come before the EngineGone
                        on_message(EngineGone(i, process.exitcode))
                    return

    def _drain(self, on_message: Callable[[object], None], grace_ms: int = 200) -> None:
        """Hand on the messages queued within `grace_ms` (an exited engine flushed its last ones before exiting;
        live replicas keep sending, so the drain is bounded in time, not by an empty socket)."""
        deadline = time.monotonic() + grace_ms / 1000
        try:
            while (left := deadline - time.monotonic()) > 0 and self._output.poll(max(1, int(left * 1000))):
                on_message(decode(self._output.recv()))
        except Exception:  # a callback that raises (e.g. the engine reported it is dead) ends the drain
            logger.debug("draining the engine socket stopped", exc_info=True)

    # -- talking -----------------------------------------------------------------------------------------------
    def send(self, msg: object, engine_index: int = 0) -> None:
        """Queue a message for one engine (call from one thread). A PUSH socket whose peer is gone would block
        forever (the abort sent while failing the requests of a dead engine): the message is dropped once the
        engine process has exited; a full queue to a live engine waits for room."""
        import zmq

        data, sock = encode(msg), self._inputs[engine_index]
        while True:
            try:
                sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                if engine_index < len(self.processes) and not self.processes[engine_index].is_alive():
                    logger.debug("engine %d is gone: %s not sent", engine_index, type(msg).__name__)
                    return
                sock.poll(50, zmq.POLLOUT)

    def is_alive(self) -> bool:
        """Every engine process runs (one gone stops the whole server)."""
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # -- shutdown ----------------------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0, kill: bool = False) -> None:
        """Ask the engines to exit (kill them after `timeout`), stop the receiver, close sockets, remove the ipc
        dir."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if not kill:
            for i, process in enumerate(self.processes):
                if process.is_alive():
                    try:
                        self.send(ShutdownEngine(), i)
                    except Exception:
                        pass
        deadline = time.monotonic() + (0 if kill else timeout)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()) if not kill else 0)
            if process.is_alive():
                process.kill()
                process.join(5)
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(5)
        for sock in self._inputs:
            sock.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __del__(self) -> None:  # a forgotten client must not leave its directory behind
        if not getattr(self, "_closed", True) and os.path.isdir(getattr(self, "_dir", "")):
            shutil.rmtree(self._dir, ignore_errors=True)
