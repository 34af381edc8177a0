"""The engine-core process: loads the model, then loops receive -> schedule/run -> send over pyzmq.

Started by `core_client.EngineCoreClient` with multiprocessing (spawn). It owns the `EngineCore` (scheduler, KV
cache, runner, encoder cache) and nothing textual: token ids and processed media come in, new token ids and the
core's counters go out (see `core_messages`). It exits when told to, when its parent process is gone, or on a fatal
error (after telling the client when it still can).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys

from vlserve.config import EngineArgs
from vlserve.engine.core_messages import (
    KV_POLL_S,
    AbortRequests,
    AddAck,
    AddRequests,
    ControlAck,
    ControlCall,
    EngineFailed,
    EngineReady,
    FinishStopped,
    ShutdownEngine,
    StepOutputs,
    decode,
    encode,
    portable_error,
)
from vlserve.engine.engine_control import CONTROL_OPS
from vlserve.engine.session_media import SessionMediaStore
from vlserve.executor import WorkerDied
from vlserve.executor.worker import share_cpu_threads

logger = logging.getLogger(__name__)

PARENT_CHECK_MS = 1000  # how often an idle engine checks that the API process still exists


def run_engine_core(
    engine_args: EngineArgs,
    input_address: str,
    output_address: str,
    engine_index: int = 0,
    log_level: int = logging.WARNING,
) -> None:
    """Process entry point: connect, load, say ready (or why not), then serve messages until shut down."""
    import zmq

    # Ctrl-C reaches the whole process group: the API process decides when the engine stops (ShutdownEngine, or
    # its own exit, which the idle loop notices).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(levelname)s engine{engine_index} %(name)s: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 5000)
    outbox.connect(output_address)
    try:
        # the API process needs a core too; data-parallel replicas split the rest (unless OMP_NUM_THREADS is set)
        share_cpu_threads(engine_args.data_parallel_size)
        from vlserve.engine.core import EngineCore

        core = EngineCore(engine_args, processor=False)  # requests arrive processed by the API process
    except BaseException as e:  # the user must see why: a bad checkpoint, an unsupported architecture...
        logger.exception("engine failed to load")
        outbox.send(encode(EngineFailed(engine_index, f"{type(e).__name__}: {e}")))
        outbox.close()
        ctx.term()
        sys.exit(1)
    loaded = core.loaded
    outbox.send(
        encode(
            EngineReady(
                engine_index,
                os.getpid(),
                core.max_model_len,
                tuple(loaded.modalities),
                tuple(loaded.eos_token_ids),
                engine_metrics(core),
            )
        )
    )
    code = 0
    try:
        _EngineLoopProc(core, inbox, outbox, engine_index).run()
    except _ParentGone:
        logger.warning("the API process is gone; engine exiting")
    except BaseException:
        logger.exception("engine process failed")
        code = 1
    finally:
        try:
            core.shutdown()  # async scheduling: finish the queued steps, stop the runner thread
        except Exception:
            logger.exception("engine core shutdown failed")
        inbox.close(linger=0)
        outbox.close()
        ctx.term()
    sys.exit(code)


class _ParentGone(Exception):
    """The API process exited while the engine still had something to tell it."""


def engine_metrics(core, session_media: SessionMediaStore | None = None) -> dict[str, float]:
    """The core's counters plus leak gauges only this process can see: requests the scheduler still holds and
    requests still referencing encoder-cache entries (both 0 when idle), and the video session items whose media
    the engine keeps (0 once every session closed)."""
    return {
        **core.get_metrics(),
        "vlserve:engine_requests_held": len(core.scheduler.requests),
        "vlserve:encoder_cache_referencing_requests": len(core.scheduler.encoder_cache.req_to_hashes),
        "vlserve:session_media_items": len(session_media) if session_media is not None else 0,
    }


class _EngineLoopProc:
    """The busy loop: apply every queued message, step while there is work, report after each step."""

    def __init__(self, core, inbox, outbox, engine_index: int):
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.engine_index = engine_index
        self.parent = multiprocessing.parent_process()
        self.session_media = SessionMediaStore()  # video session items' media, sent once (session_media.py)

    def run(self) -> None:
        import zmq

        while True:
            idle = not self.core.has_unfinished_requests()
            polling = idle and self.core.has_kept_kv_blocks()  # kept KV blocks: poll the connector until freed
            if idle and not self.inbox.poll(int(KV_POLL_S * 1000) if polling else PARENT_CHECK_MS, zmq.POLLIN):
                if polling:
                    self._poll_kv()
                    continue
                if not self._parent_alive():
                    logger.warning("the API process is gone; engine exiting")
                    return
                continue
            handled = 0
            while self.inbox.poll(0, zmq.POLLIN):
                if not self._handle(decode(self.inbox.recv())):
                    return
                handled += 1
            if self.core.has_unfinished_requests():
                self._step()
            elif self.core.has_kept_kv_blocks():
                self._poll_kv()
            elif handled:  # aborts on an idle engine: let the client see the counters settle
                self._send(StepOutputs(self.engine_index, [], self._metrics()))

    def _handle(self, msg: object) -> bool:
        """Apply one message; False on shutdown."""
        if isinstance(msg, AddRequests):
            self._add(msg)
        elif isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, FinishStopped):
            self.core.finish_requests_stopped(msg.request_ids)
        elif isinstance(msg, ControlCall):
            self._control(msg)
        elif isinstance(msg, ShutdownEngine):
            return False
        else:
            logger.error("unknown message %s ignored", type(msg).__name__)
        return True

    def _add(self, msg: AddRequests) -> None:
        queued: list[str] = []
        try:
            for req in msg.requests:
                if any(f.session_id is not None for f in req.mm_features):
                    req.mm_features = self.session_media.resolve(req.mm_features)
                self.core.add_request(req)
                queued.append(req.request_id)
        except Exception as e:  # all or none, like EngineLoop.add_requests
            self.core.abort_requests(queued)
            self._send(AddAck(self.engine_index, msg.user_request_id, portable_error(e), self._metrics()))
            return
        self._send(AddAck(self.engine_index, msg.user_request_id, None, self._metrics()))

    def _control(self, msg: ControlCall) -> None:
        if msg.op == "add_lora":  # loads off the step loop: acknowledged between steps when it ends
            self.core.add_lora_async(
                msg.arg,
                lambda err, result: self._send(
                    ControlAck(self.engine_index, msg.call_id, result, None if err is None else portable_error(err))
                ),
            )
            return
        try:
            if msg.op not in CONTROL_OPS:
                raise ValueError(f"unknown control call {msg.op!r}")
            if msg.op == "evict_encoder_items":
                self.session_media.evict(msg.arg)
            ack = ControlAck(self.engine_index, msg.call_id, getattr(self.core, msg.op)(msg.arg))
        except Exception as e:
            ack = ControlAck(self.engine_index, msg.call_id, error=portable_error(e))
        ack.metrics = self._metrics()
        self._send(ack)

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except WorkerDied as e:  # a rank is gone: fail the requests in flight, then exit non-zero
            logger.error("%s", e)
            self._send(StepOutputs(self.engine_index, [], self._metrics(), f"{type(e).__name__}: {e}", fatal=True))
            raise
        except Exception as e:
            logger.exception("engine step failed; dropping the requests in flight")
            self.core.abort_requests(list(self.core.scheduler.requests))
            self._send(StepOutputs(self.engine_index, [], self._metrics(), f"{type(e).__name__}: {e}"))
            return
        if outputs or self.core.scheduler.has_unfinished_requests():  # not for steps that only polled adapter loads
            self._send(StepOutputs(self.engine_index, outputs, self._metrics()))

    def _poll_kv(self) -> None:
        """An idle step for the connector's kept blocks; the client hears of it when some were freed."""
        kept = len(self.core.scheduler.kv_transfer.kept_blocks)
        self._step()
        if len(self.core.scheduler.kv_transfer.kept_blocks) != kept:
            self._send(StepOutputs(self.engine_index, [], self._metrics()))

    def _metrics(self) -> dict[str, float]:
        return engine_metrics(self.core, self.session_media)

    def _send(self, msg: object) -> None:
        """Send, unless the API process is gone (a PUSH socket without a peer would block forever)."""
        import zmq

        data = encode(msg)
        while not self.outbox.poll(PARENT_CHECK_MS, zmq.POLLOUT):
            if not self._parent_alive():
                raise _ParentGone()
        self.outbox.send(data)

    def _parent_alive(self) -> bool:
        return self.parent is None or self.parent.is_alive()
