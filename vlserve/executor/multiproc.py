"""Tensor-parallel ranks and pipeline stages as worker processes on this machine (multiprocessing, spawn), one pipe
each.

Each step the executor pickles the SchedulerOutput once and writes it to every rank's pipe (`submit_execute`; the
answers are read by `collect_execute`, oldest first, so under pipeline parallelism several steps can be queued on
the pipes: stage 0 runs step k + 1 while the last stage runs step k); every rank runs the
step (the collectives inside the model, and the hand-over between pipeline stages, join them over
torch.distributed) and answers with its output. The sampling rank's output is the step's result (rank 0's, or the
last stage's under pipeline parallelism); the others' sampled ids must equal it (the logits are all-gathered, so
every tensor-parallel rank samples the same tokens with the same generator state, and the last stage broadcasts its
tokens to the other stages), which the executor checks.

While it waits, the executor also watches every rank's process sentinel: a rank that dies (killed, out of memory, a
crash inside a collective) turns into `WorkerDied` at once, naming the rank and its exit code; the remaining ranks
are then stopped, so nothing hangs.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import socket
import traceback
from multiprocessing.connection import Connection, wait

from vlserve.executor.base import RankGroupExecutor
from vlserve.executor.worker import Worker, WorkerSettings, WorkerStats, rank_device, share_cpu_threads

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # how long a rank gets to exit after "shutdown" before it is killed


def free_tcp_port() -> int:
    """A TCP port nobody listens on right now (for the process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(conn: Connection, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def run_worker_process(
    settings: WorkerSettings, rank: int, world_size: int, init_method: str, conn: Connection, log_level: int
) -> None:
    """A rank's process: load its shard, say ready (or why not), then answer calls until told to stop or until the
    executor's end of the pipe closes (the engine is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; it stops the ranks
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    if rank_device(settings.args.device, rank).type == "cpu":
        share_cpu_threads(world_size)
    try:
        worker = Worker.start_rank(settings, rank, world_size, init_method)
        _send(conn, ("ok", None))
    except BaseException as e:
        logger.exception("rank %d failed to load", rank)
        _send(conn, ("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    while True:
        try:
            method, arg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the executor is gone
        if method == "shutdown":
            return
        try:
            if method == "execute_model":
                result = (worker.execute_model(arg), worker.stats())
            else:
                result = getattr(worker, method)(arg)
            _send(conn, ("ok", result))
        except BaseException as e:
            _send(conn, ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            raise SystemExit(1) from None


class MultiprocExecutor(RankGroupExecutor):
    """`tensor_parallel_size x pipeline_parallel_size` worker processes, one per rank (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, settings: WorkerSettings):
        args = settings.args
        self.world_size = args.world_size
        self.tp_size, self.pp_size = args.tensor_parallel_size, args.pipeline_parallel_size
        self.output_rank = (self.pp_size - 1) * self.tp_size  # the last stage's first rank samples
        self.device = rank_device(args.device, 0)
        self._dead: str | None = None  # why the ranks can no longer run steps
        self._stats = WorkerStats()
        self._num_sent = self._num_collected = 0  # calls written to the pipes, and answered (FIFO)
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        try:
            for rank in range(self.world_size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=run_worker_process,
                    name=f"vlserve-rank{rank}",
                    daemon=True,
                    args=(
                        settings,
                        rank,
                        self.world_size,
                        init_method,
                        theirs,
                        logging.getLogger("vlserve").getEffectiveLevel(),
                    ),
                )
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)
            self._collect("start-up")
            self._size_and_allocate_caches()
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "%d TP x %d PP ranks (pids %s), %d KV blocks each",
            self.tp_size,
            self.pp_size,
            [p.pid for p in self.procs],
            self.num_blocks,
        )

    # -- calls -------------------------------------------------------------------------------------------------
    def _submit(self, method: str, arg=None) -> int:
        """Write one call to every rank's pipe (pickled once); its number, for `_collect_call`."""
        blob = pickle.dumps((method, arg), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(blob)
            except OSError:
                self._fail(self._death_of(rank))
        self._num_sent += 1
        return self._num_sent - 1

    def _collect_call(self, handle: int, method: str) -> list:
        """The answers to call number `handle`: each rank answers its calls in order, so the next answer on every
        pipe is the oldest uncollected call's."""
        if handle != self._num_collected:
            raise RuntimeError(f"call {handle} collected out of order (call {self._num_collected} is older)")
        results = self._collect(method)
        self._num_collected += 1
        return results

    def _collect(self, what: str) -> list:
        """Wait for every rank's answer to `what`, watching the processes: a death or an error raises at once."""
        results: list = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while pending:
            watched = [s for s, rank in sentinels.items() if rank in pending.values()]
            for ready in wait(list(pending) + watched):
                if isinstance(ready, Connection):
                    rank = pending.pop(ready)
                    try:
                        status, value = pickle.loads(ready.recv_bytes())
                    except (EOFError, OSError):
                        self._fail(self._death_of(rank))
                    if status != "ok":
                        self._fail_dead_peer(rank)  # e.g. a stage whose neighbour died mid-hand-over
                        self._fail(f"{self._rank_name(rank)} failed during {what}: {value}")
                    results[rank] = value
                elif sentinels[ready] in pending.values():  # a rank that has not answered is gone
                    rank = sentinels[ready]
                    conn = self.conns[rank]
                    if conn.poll():  # it answered before exiting (e.g. with its error): read that first
                        continue
                    self._fail(self._death_of(rank))
        return results

    def _fail_dead_peer(self, rank: int, grace_s: float = 1.0) -> None:
        """When a rank reports an error, fail naming another rank that died (its error is likely the consequence)."""
        others = {p.sentinel: r for r, p in enumerate(self.procs) if r != rank}
        dead = wait(list(others), timeout=grace_s)
        if dead:
            self._fail(self._death_of(others[dead[0]]))

    def _death_of(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        code = proc.exitcode
        how = (
            f"was killed by signal {-code}"
            if code is not None and code < 0
            else f"exited with code {code}"
            if code is not None
            else "stopped answering"
        )
        return f"{self._rank_name(rank)} (pid {proc.pid}) {how}; the engine cannot continue"

    def _stop_ranks(self) -> None:
        self.shutdown(kill=True)

    # -- the executor interface --------------------------------------------------------------------------------
    def shutdown(self, kill: bool = False) -> None:
        """Ask every rank to stop, then kill the ones still running after a grace period (at once with `kill`)."""
        for conn in self.conns:
            try:
                _send(conn, ("shutdown", None))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=0 if kill else STOP_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=STOP_GRACE_S)
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.procs = []
