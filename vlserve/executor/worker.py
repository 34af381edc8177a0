"""One rank's share of the model: its weights (a tensor-parallel shard, a pipeline stage's layers, or the whole
model), its KV cache and the model runner that executes each step. The executors build one `Worker` per rank, in
this process or in another."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vlserve.config import EngineArgs
from vlserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from vlserve.distributed.parallel_state import init_model_parallel, pp_size, tp_size
from vlserve.distributed.pipeline import is_last_stage
from vlserve.kernels.kv_quant import kv_cache_torch_dtype
from vlserve.models.capabilities import capabilities_of
from vlserve.multimodal.mrope import get_mrope_positions
from vlserve.pooling_params import PoolerSpec
from vlserve.spec_decode import SpeculativeConfig, build_proposer
from vlserve.worker.deferred_samples import StepHandle
from vlserve.worker.encoder_only_runner import EncoderOnlyRunner
from vlserve.worker.kv_free_runner import KvFreeRunner
from vlserve.worker.kv_sizing import determine_num_kv_blocks
from vlserve.worker.model_runner import ModelRunner
from vlserve.worker.pooler import build_pooler
from vlserve.worker.pp_stage import PipelineStageRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankModel:
    """The tensors side of a checkpoint as one rank holds it (what the runner and a draft proposer need)."""

    model_path: str
    hf_config: Any
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    mrope_positions_fn: Callable | None = None


@dataclass(frozen=True)
class WorkerSettings:
    """What every rank is told at start-up (plain data: it is pickled to worker processes)."""

    args: EngineArgs
    model_path: str
    max_model_len: int
    max_num_batched_tokens: int
    spec_config: SpeculativeConfig | None = None
    pooler: PoolerSpec | None = None  # a pooling engine's pooler (None: the runner samples)


@dataclass(frozen=True)
class WorkerStats:
    """A rank's counters, read after each step (the executor keeps rank 0's for /metrics)."""

    num_encoder_runs: int = 0
    encoder_runs_by_modality: dict[str, int] = field(default_factory=dict)
    num_requests: int = 0  # requests the runner still holds state for
    num_graph_replays: int = 0  # decoder forwards answered by a CUDA graph replay
    num_eager_forwards: int = 0  # decoder forwards run without a graph
    ec_counters: dict[str, int] = field(default_factory=dict)  # the encoder-cache connector's (ec_*_total)
    num_partial_encodes: int = 0  # items the runner holds a partial tower state of (encoded over several steps)


def mrope_positions_fn_for(model: Any, hf_config: Any) -> Callable | None:
    """For M-RoPE models: `(prompt_ids, mm_features, kept_indices=None) -> ([3, P] positions, delta)` (kept_indices:
    pruned videos' kept grid indices by mm_hash, see vlserve.multimodal.mrope); None otherwise."""
    if not capabilities_of(model).mrope:
        return None

    def mrope_fn(ids, feats, kept_indices=None):
        return get_mrope_positions(ids, feats, hf_config, kept_indices=kept_indices)

    return mrope_fn


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: `cuda:r` on CUDA (one GPU per rank), the CPU otherwise."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", rank)
    return dev


def load_rank_model(settings: WorkerSettings, rank: int) -> RankModel:
    """Build this rank's shard of the checkpoint (the whole model when not tensor parallel)."""
    from transformers import AutoConfig

    from vlserve.models.loader import load_model, resolve_dtype

    hf_config = AutoConfig.from_pretrained(settings.model_path)
    device = rank_device(settings.args.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = resolve_dtype(settings.args.dtype, hf_config)
    torch.manual_seed(settings.args.seed)
    model = load_model(
        settings.model_path,
        hf_config,
        dtype,
        device,
        settings.args.quantization,
        mm_encoder_quantization=settings.args.mm_encoder_quantization,
        # tower adapters (LoRA) need whole tower linears: with LoRA on, the towers stay replicated
        shard_towers=settings.args.mm_encoder_tp_mode == "weights" and not settings.args.enable_lora,
    )
    return RankModel(settings.model_path, hf_config, model, device, dtype, mrope_positions_fn_for(model, hf_config))


class Worker:
    """A rank: its model (shard), KV cache and runner. `determine_num_blocks`, then `initialize`, then steps."""

    def __init__(self, settings: WorkerSettings, rank_model: RankModel):
        self.settings = settings
        args = settings.args
        self.rank_model = rank_model
        if args.mm_encoder_only:  # an encode server: the towers only, no KV cache, nothing sampled
            self.runner = EncoderOnlyRunner(rank_model.model, rank_model.device, rank_model.dtype)
            return
        if capabilities_of(rank_model.model).kv_free:  # no decoder, no KV cache: whole prompts pooled in one call
            if settings.pooler is None:
                raise ValueError("a model with no decoder only pools: runner='pooling' (--runner pooling)")
            self.runner = KvFreeRunner(
                rank_model.model, rank_model.device, rank_model.dtype, args.block_size, settings.pooler
            )
            return
        staged = pp_size() > 1  # a pipeline stage: eager for now (EngineArgs refuses a compilation level)
        # Drafts are proposed where tokens are sampled: the last stage (the n-gram proposer reads only token ids; the
        # scheduler hands its drafts to every stage in the next SchedulerOutput, the last stage verifies them).
        proposer = (
            build_proposer(settings.spec_config, settings.max_model_len, rank_model, args.block_size)
            if is_last_stage()
            else None
        )
        self.runner = (PipelineStageRunner if staged else ModelRunner)(
            rank_model.model,
            rank_model.hf_config,
            rank_model.device,
            rank_model.dtype,
            args.block_size,
            mrope_positions_fn=rank_model.mrope_positions_fn,
            proposer=proposer,
            compilation_config=args.compilation_config,
            enforce_eager=args.enforce_eager or staged,
            kv_cache_dtype=kv_cache_torch_dtype(args.kv_cache_dtype, rank_model.dtype, rank_model.device),
            prefill_only=settings.pooler is not None,
            lora_config=None
            if not args.enable_lora
            else {
                "max_loras": args.max_loras,
                "max_lora_rank": args.max_lora_rank,
                "max_cpu_loras": args.max_cpu_loras,
            },
        )
        # async scheduling: a step may return with its sampled ids on the device; the next step reads them there
        self.runner.defer_readback = bool(args.async_scheduling) and not staged
        if settings.pooler is not None:
            self.runner.pooler = build_pooler(rank_model.model, settings.pooler, rank_model.dtype)

    @classmethod
    def start_rank(cls, settings: WorkerSettings, rank: int, world_size: int, init_method: str) -> Worker:
        """In a rank's own process: join the tensor- and pipeline-parallel groups, then load this rank's shard."""
        backend = "nccl" if rank_device(settings.args.device, rank).type == "cuda" else "gloo"
        args = settings.args
        if world_size != args.tensor_parallel_size * args.pipeline_parallel_size:
            raise ValueError(
                f"{world_size} ranks for {args.tensor_parallel_size} TP x {args.pipeline_parallel_size} PP"
            )
        init_model_parallel(rank, args.tensor_parallel_size, args.pipeline_parallel_size, init_method, backend)
        return cls(settings, load_rank_model(settings, rank))

    def determine_num_blocks(self, memory_share: float = 1.0) -> int:
        """How many KV blocks this rank can hold (`memory_share`: the part of the host memory budget that is this
        rank's when several ranks share one machine's RAM)."""
        args = self.settings.args
        if args.mm_encoder_only:
            return 0  # an encode server holds no KV cache
        if isinstance(self.runner, KvFreeRunner):  # block ids only, no memory behind them
            return self.runner.num_blocks(args.num_kv_blocks, args.max_num_seqs, self.settings.max_model_len)
        return determine_num_kv_blocks(
            self.runner,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            memory_fraction=args.kv_cache_memory_fraction * memory_share,
            max_num_batched_tokens=self.settings.max_num_batched_tokens,
            max_model_len=self.settings.max_model_len,
            max_num_seqs=args.max_num_seqs,
        )

    def initialize(self, num_blocks: int) -> None:
        """Allocate the KV cache (the same block count on every rank) and compile / capture per the level."""
        self.runner.initialize_kv_cache(num_blocks)
        cfg = self.settings.args.kv_transfer_config
        if cfg is not None:  # the KV connector's worker side, given this rank's KV tensors
            from vlserve.distributed.kv_transfer.base import KVConnectorRole
            from vlserve.distributed.kv_transfer.factory import create_connector
            from vlserve.distributed.parallel_state import pp_rank, tp_rank

            self.runner.set_kv_connector(
                create_connector(
                    cfg,
                    KVConnectorRole.WORKER,
                    block_size=self.settings.args.block_size,
                    rank=pp_rank() * self.settings.args.tensor_parallel_size + tp_rank(),
                )
            )
        # mm_encoder_tp_mode="data": each tensor-parallel rank encodes its share of a step's media items
        self.runner.encoders.split_across_ranks = self.settings.args.mm_encoder_tp_mode == "data" and tp_size() > 1
        ec_cfg = self.settings.args.ec_transfer_config
        if ec_cfg is not None:  # encoder outputs through a shared directory (distributed/ec_transfer)
            from vlserve.distributed.ec_transfer.shared_storage import ECSharedStorageConnector

            self.runner.encoders.ec_connector = ECSharedStorageConnector(ec_cfg, self.runner.device, self.runner.dtype)
        self.runner.warm_up_model(self.settings.args.max_num_seqs, self.settings.max_model_len)

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one planned step on this rank."""
        return self.runner.execute_model(sched_out)

    def launch_step(self, sched_out: SchedulerOutput) -> StepHandle:
        """Run one step, its sampled ids possibly left on the device (`defer_readback`): a `StepHandle`, whose
        `output()` is the step's output (in process only)."""
        if getattr(self.runner, "defer_readback", False):
            return self.runner.submit_step(sched_out)
        return StepHandle(self.runner.execute_model(sched_out))

    def stage_timing(self, reset: bool = False) -> dict | None:
        """A pipeline stage's busy / hand-over wait / span seconds since the last reset (None without PP)."""
        timing = getattr(self.runner, "stage_timing", None)
        return None if timing is None else timing(reset)

    def add_lora(self, lora_request) -> bool:
        """Parse a LoRA adapter into host memory (ValueError on a bad adapter); False if it was held already."""
        return self._lora_manager().add_adapter(lora_request)

    def start_lora_load(self, lora_request) -> bool:
        """Start reading a LoRA adapter's files off the step loop; False if it is held or loading already."""
        return self._lora_manager().start_loading(lora_request)

    def finished_lora_loads(self, _=None) -> dict[int, str | None]:
        """The adapter loads that ended since the last call: lora_int_id -> None (held now) or the error."""
        return self._lora_manager().finished_loads()

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a LoRA adapter from host memory and its device slot; False if it was not held."""
        return self._lora_manager().remove_adapter(lora_int_id)

    def _lora_manager(self):
        if self.runner.lora_manager is None:
            raise ValueError("LoRA is not enabled on this engine (enable_lora)")
        return self.runner.lora_manager

    def shard_info(self, _=None) -> dict:
        """What this rank holds: its tensor-parallel rank and group size, its pipeline stage and the number of
        stages, its parameter count, its KV cache shape and how many layers have a KV cache here; whether it splits
        media items with the other ranks (`mm_encoder_tp_mode="data"`) and how many items its tower encoded."""
        from vlserve.distributed.parallel_state import pp_rank, tp_rank, tp_size

        model = self.rank_model.model
        numel = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # tied weights once
        held = [kv for kv in self.runner.kv_caches if kv is not None]
        return {
            "rank": tp_rank(),
            "world_size": tp_size(),
            "pp_rank": pp_rank(),
            "pp_size": pp_size(),
            "num_params": numel,
            "kv_cache_shape": tuple(held[0][0].shape) if held else None,
            "num_kv_layers": len(held),
            "layers": (self.runner.kv_layers.start, self.runner.kv_layers.stop),
            "split_encoder_items": self.runner.encoders.split_across_ranks,
            "encoder_items_run_here": self.runner.encoders.counters().num_local_runs,
        }

    def stats(self) -> WorkerStats:
        """This rank's counters now."""
        r = self.runner
        fwd, enc = r.forward, r.encoders.counters()  # (forward: None on an encode server, no decoder forward)
        return WorkerStats(
            enc.num_runs,
            enc.runs_by_modality,
            len(r.requests),
            0 if fwd is None else fwd.num_graph_replays,
            0 if fwd is None else fwd.num_eager_forwards,
            enc.ec_counters,
            enc.num_partial,
        )


FRONTEND_CORE_FROM = 4  # machines with at least this many cores keep one core for the API process


def cpu_threads_per_process(cores: int, world_size: int) -> int:
    """Threads each of `world_size` engine processes takes on `cores` cores: their part of all cores but one
    (left to the API process or the engine loop) on machines of FRONTEND_CORE_FROM cores or more, of all of them
    below that. OpenMP threads that lose their core stall every parallel region, so oversubscribing costs far more
    than one idle core on a big machine; on a 2-core one the spare core halved the engine (448x448 images at
    concurrency 8: 0.82 req/s with one engine thread, 1.47 with two, the API process's light work fitting between)."""
    spare = 1 if cores >= FRONTEND_CORE_FROM else 0
    return max(1, (cores - spare) // world_size)


def share_cpu_threads(world_size: int) -> None:
    """`world_size` processes (ranks, or data-parallel engines) on one machine's CPU: each sets torch's threads to
    `cpu_threads_per_process`, unless the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(cpu_threads_per_process(cores, world_size))
