"""`EngineCoreClient`: the API process's end of one engine-core process (spawn, pyzmq sockets, handshake).

Sockets, bound by the client on ipc:// paths in a private temporary directory: a PUSH socket per engine (its
input) and one PULL socket all engines push to (messages carry `engine_index`), so a later client for N engine
processes (data-parallel replicas) keeps this shape. After the handshake a receiver thread owns the PULL socket:
it hands each decoded message to a callback and, when the process exits, hands an `EngineGone` instead.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

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
    """Starts one engine-core process and talks to it; `start()` blocks until it is ready (or raises)."""

    def __init__(self, engine_args: EngineArgs, engine_index: int = 0,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT):
        import zmq

        self.engine_args = engine_args
        self.engine_index = engine_index
        self.startup_timeout = startup_timeout
        self._dir = tempfile.mkdtemp(prefix="vlserve-engine-")
        self.input_address = f"ipc://{self._dir}/input-{engine_index}"
        self.output_address = f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(self.input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self.output_address)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.ready: EngineReady | None = None
        self._receiver: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = False

    # -- start-up ----------------------------------------------------------------------------------------------
    def spawn(self) -> None:
        """Start the engine process (it begins loading the model); `wait_ready()` then waits for it."""
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=run_engine_core, name=f"vlserve-engine-{self.engine_index}",
                                   args=(self.engine_args, self.input_address, self.output_address,
                                         self.engine_index, logging.getLogger().getEffectiveLevel()),
                                   daemon=True)
        self.process.start()

    def wait_ready(self) -> EngineReady:
        """Block until the engine says ready; EngineStartupError (with the engine's own error text) if not."""
        deadline = time.monotonic() + self.startup_timeout
        try:
            while True:
                if self._output.poll(_POLL_MS):
                    msg = decode(self._output.recv())
                    if isinstance(msg, EngineReady):
                        self.ready = msg
                        return msg
                    if isinstance(msg, EngineFailed):
                        raise EngineStartupError(f"the engine process failed to start: {msg.error}")
                    logger.warning("unexpected %s before the engine was ready", type(msg).__name__)
                elif not self.process.is_alive():
                    raise EngineStartupError(f"the engine process exited (code {self.process.exitcode}) before "
                                             "it was ready; see its log above")
                elif time.monotonic() > deadline:
                    raise EngineStartupError(f"the engine process was not ready after {self.startup_timeout:.0f}s")
        except BaseException:
            self.close(kill=True)
            raise

    def start_receiver(self, on_message: Callable[[object], None]) -> None:
        """Hand every later engine message to `on_message` from a daemon thread (and an EngineGone at the end)."""
        self._receiver = threading.Thread(target=self._receive_loop, args=(on_message,),
                                          name=f"vlserve-engine-{self.engine_index}-recv", daemon=True)
        self._receiver.start()

    def _receive_loop(self, on_message: Callable[[object], None]) -> None:
        while not self._stopping.is_set():
            try:
                if self._output.poll(_POLL_MS):
                    on_message(decode(self._output.recv()))
                    continue
            except Exception:  # sockets closed under us at shutdown
                if self._stopping.is_set():
                    return
                logger.exception("engine receiver failed")
                on_message(EngineGone(self.engine_index, None))
                return
            if not self.process.is_alive():
                if not self._stopping.is_set():
                    on_message(EngineGone(self.engine_index, self.process.exitcode))
                return

    # -- talking -----------------------------------------------------------------------------------------------
    def send(self, msg: object) -> None:
        """Queue a message for the engine (never blocks; call from one thread)."""
        self._input.send(encode(msg))

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    # -- shutdown ----------------------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0, kill: bool = False) -> None:
        """Ask the engine to exit (kill it after `timeout`), stop the receiver, close sockets, remove the ipc dir."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self.process is not None and self.process.is_alive():
            if not kill:
                try:
                    self.send(ShutdownEngine())
                except Exception:
                    pass
                self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(5)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __del__(self) -> None:  # a forgotten client must not leave its directory behind
        if not getattr(self, "_closed", True) and os.path.isdir(getattr(self, "_dir", "")):
            shutil.rmtree(self._dir, ignore_errors=True)
