"""Tensor-parallel ranks and pipeline stages as Ray actors (`--distributed-executor-backend ray`), placed by one
placement group.

The executor joins the Ray cluster at RAY_ADDRESS, or an already initialised one, or else starts a local one (and
then shuts it down again in `shutdown`). It reserves one bundle per rank ({"CPU": 1}, or {"GPU": 1, "CPU": 1} on
CUDA; `tensor_parallel_size x pipeline_parallel_size` of them, rank = stage x TP + TP rank as under the mp backend),
starts one actor per bundle, and lets rank 0's actor name the rendezvous address (its node IP and a free port). The
PACK strategy keeps ranks together where they fit; what does not fit spills onto the next node, so a two-node
cluster with one GPU each runs `pipeline_parallel_size=2` with a stage per node. Each call goes to every actor at
once (`submit_execute`: several steps may be queued on the actors under pipeline parallelism, each actor runs them
in order); the executor waits on all the futures with `ray.wait`, so the first rank that dies or fails stops the rest at
once (a rank blocked in a collective with the lost one is killed, not waited for) and surfaces as `WorkerDied`
naming the rank (and its stage). Like the mp backend, the sampling rank's output (rank 0's, or the last stage's
first rank's) is the step's result and the other ranks' sampled ids must equal it.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace

from vlserve.executor.base import RankGroupExecutor
from vlserve.executor.worker import Worker, WorkerSettings, WorkerStats, rank_device, share_cpu_threads

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # how long the placement group may wait for the cluster's resources


def import_ray():
    """The `ray` module, or a ValueError saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ValueError(
            "distributed_executor_backend 'ray' needs Ray: install vlserve[ray] (pip install 'vlserve[ray]')"
        ) from e
    return ray


class RankActor:
    """One rank inside a Ray actor process: a thin shell around `Worker` (wrapped with `ray.remote` when used)."""

    def __init__(self, log_level: int, cpu_threads_from_user: bool):
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
        self.cpu_threads_from_user = cpu_threads_from_user
        self.worker: Worker | None = None

    def rendezvous_address(self) -> str:
        """`tcp://<this node's IP>:<a port free here>` for the process group (asked of rank 0's actor)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, settings: WorkerSettings, rank: int, world_size: int, init_method: str) -> None:
        """Join the group and load this rank's shard."""
        if rank_device(settings.args.device, rank).type == "cpu":
            if not self.cpu_threads_from_user:
                os.environ.pop("OMP_NUM_THREADS", None)  # Ray sets it to the actor's CPU count (1): share instead
            share_cpu_threads(world_size)
        self.worker = Worker.start_rank(settings, rank, world_size, init_method)

    def call(self, method: str, arg=None):
        """`Worker.<method>(arg)`; for `execute_model`, the output and the rank's stats after it."""
        if method == "execute_model":
            return self.worker.execute_model(arg), self.worker.stats()
        return getattr(self.worker, method)(arg)


class RayExecutor(RankGroupExecutor):
    """`tensor_parallel_size x pipeline_parallel_size` Ray actors, one per rank (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, settings: WorkerSettings):
        self.ray = ray = import_ray()
        args = settings.args
        self.world_size = args.world_size
        self.tp_size, self.pp_size = args.tensor_parallel_size, args.pipeline_parallel_size
        self.output_rank = (self.pp_size - 1) * self.tp_size  # the last stage's first rank samples
        self.device = rank_device(args.device, 0)
        self._dead: str | None = None  # why the ranks can no longer run steps
        self._stats = WorkerStats()
        self.actors: list = []
        self.placement_group = None
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            self._init_ray()
        try:
            self._place_actors(settings)
            self._size_and_allocate_caches()
        except BaseException:
            self.shutdown()
            raise
        logger.info("on Ray: %d TP x %d PP ranks, %d KV blocks each", self.tp_size, self.pp_size, self.num_blocks)

    def _init_ray(self) -> None:
        """Join the cluster at RAY_ADDRESS, or start a local one with room for every rank (no dashboard)."""
        quiet = dict(include_dashboard=False, logging_level=logging.WARNING)
        address = os.environ.get("RAY_ADDRESS")
        if address:
            self.ray.init(address=address, **quiet)
        else:
            cpus = os.cpu_count() or 1
            self.ray.init(num_cpus=max(cpus, self.world_size), **quiet)

    def _place_actors(self, settings: WorkerSettings) -> None:
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        on_gpu = self.device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
        self.placement_group = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {self.world_size} ranks ({self.tp_size} TP x {self.pp_size} PP, {bundle} "
                f"each) within {PLACEMENT_TIMEOUT_S:g} s: the cluster has {ray.available_resources()} available "
                f"and {ray.cluster_resources()} in all; add resources or lower tensor_parallel_size / "
                f"pipeline_parallel_size"
            )
        if on_gpu:  # Ray shows each actor only its own GPU, which is cuda:0 inside the actor
            settings = replace(settings, args=replace(settings.args, device="cuda:0"))
        actor_cls = ray.remote(RankActor)
        log_level = logging.getLogger("vlserve").getEffectiveLevel()
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank
            )
            self.actors.append(
                actor_cls.options(
                    num_cpus=1, num_gpus=1 if on_gpu else 0, scheduling_strategy=strategy, max_restarts=0
                ).remote(log_level, "OMP_NUM_THREADS" in os.environ)
            )
        init_method = self._wait_all([self.actors[0].rendezvous_address.remote()], "start-up", ranks=[0])[0]
        self._wait_all(
            [a.start.remote(settings, rank, self.world_size, init_method) for rank, a in enumerate(self.actors)],
            "start-up",
        )

    # -- calls -------------------------------------------------------------------------------------------------
    def _submit(self, method: str, arg=None) -> list:
        """One call to every actor (an actor runs its calls in order, so steps can queue); their futures."""
        arg_ref = self.ray.put(arg)  # serialised once, shared by every actor
        return [a.call.remote(method, arg_ref) for a in self.actors]

    def _collect_call(self, handle: list, method: str) -> list:
        return self._wait_all(handle, method)

    def _wait_all(self, refs: list, what: str, ranks: list[int] | None = None) -> list:
        """Every future's value, in order; the first rank to die or fail stops all ranks and raises WorkerDied."""
        ray = self.ray
        from ray import exceptions as rex

        ranks = list(range(len(refs))) if ranks is None else ranks
        pending = {ref: i for i, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                i = pending.pop(ref)
                rank = ranks[i]
                try:
                    results[i] = ray.get(ref)
                except (rex.RayActorError, rex.WorkerCrashedError) as e:
                    self._fail(
                        f"{self._rank_name(rank)} (Ray actor {self._actor_id(rank)}) died during "
                        f"{what}: {type(e).__name__}; the engine cannot continue"
                    )
                except rex.RayError as e:
                    self._fail(f"{self._rank_name(rank)} (Ray actor {self._actor_id(rank)}) failed during {what}: {e}")
        return results

    def _actor_id(self, rank: int) -> str:
        try:
            return self.actors[rank]._actor_id.hex()
        except (IndexError, AttributeError):
            return "?"

    def _stop_ranks(self) -> None:
        self._kill_actors()

    # -- the executor interface --------------------------------------------------------------------------------
    def _kill_actors(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []

    def shutdown(self) -> None:
        """Kill the actors and free their placement group; shut Ray down only if this executor started it."""
        if not self.ray.is_initialized():
            return
        self._kill_actors()
        if self.placement_group is not None:
            from ray.util import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:  # the cluster is already gone
                pass
            self.placement_group = None
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False
