"""The runner's one call into the decoder: eager, `torch.compile`d, or a CUDA-graph replay (CompilationConfig).

Compiled (level >= 1): the model's forward is traced by dynamo and compiled by inductor (CPU and CUDA) with the
token dimension dynamic, so a shape class compiles once: T == 1 (dynamo specializes size 1) and T >= 2, times
[T] vs [3, T] positions and token ids vs media embeddings. On CPU the weights are frozen into the graph, so
inductor runs the linear layers on oneDNN with prepacked weights (`CompilationConfig.inductor_options`). Attention
stays one opaque custom op (`kernels.attention_op`) that reads this step's metadata and KV caches from
`attention_step`; everything else (RMSNorm with its residual add, SiLU-and-mul, rotary) is plain torch, which
inductor fuses. Inductor's on-disk
caches (FX graph and autograd caches) live in the config's cache dir, so a second start skips most of the work.
Level >= 2 on CUDA also captures CUDA graphs for decode batches (`cuda_graphs.py`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import types

import torch

from vlserve.config import CompilationConfig, default_capture_sizes, default_compile_cache_dir
from vlserve.kernels.attention_op import attention_step
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.kernels.packed_linear import row_breaks
from vlserve.models.capabilities import capabilities_of
from vlserve.models.llama import decoder_of
from vlserve.worker.cuda_graphs import CudaGraphRunner, DecodeBuffers, StepInputs

logger = logging.getLogger(__name__)


def use_compile_cache_dir(path: str) -> str:
    """Point inductor's (and, under it, Triton's) on-disk caches at `path`; returns it."""
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


_INSTANCES = itertools.count()


def _own_code(method):
    """`method` rebuilt on a code object of its own. Dynamo keeps its compiled graphs (and counts recompiles) per
    code object; frozen weights are guarded by identity, so every model in a process would otherwise be a
    recompile of one shared function, and the eighth would hit dynamo's recompile limit."""
    fn = method.__func__
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_INSTANCES)}")
    return types.MethodType(
        types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__), method.__self__
    )


def shape_classes(model: torch.nn.Module) -> list[tuple[int, bool]]:
    """(tokens, from embeddings) of one step per shape class the compiled decoder meets: a 1-token decode, prefills
    of 2 tokens and of each row count from which a linear takes another path (`row_breaks`: bf16 on AMX hands 128+
    rows to oneDNN, and the graph guards there), and for a multimodal model those prefills again from embeddings, as
    every step that carries media runs. A class the warm-up leaves out compiles on the first step that needs it,
    seconds to minutes into serving."""
    prefills = [2, *row_breaks(decoder_of(model))]
    classes = [(n, False) for n in prefills] + [(1, False)]
    if capabilities_of(model).multimodal:
        classes += [(n, True) for n in prefills]
    return classes


_INPUT_NAMES = ("input_ids", "positions", "inputs_embeds")  # `_decoder_call`'s arguments


def keep_input_guards(entries) -> list[bool]:
    """Dynamo guard filter: keep the guards on the forward's inputs (their dtype, shape class, None-ness), the
    symbolic-shape and global-state guards (no name); drop those on the model's modules and the globals its code
    reads. Each ModelForward compiles a code object of its own (`_own_code`) for one model whose modules do not
    change after loading, so those guards always pass, and checking them (hundreds per step) costs ~0.3 ms."""
    return [entry.name in _INPUT_NAMES or entry.name == "" for entry in entries]


class ModelForward:
    """`forward(input_ids, positions, kv_caches, md, inputs_embeds) -> hidden [T, H]` at the configured level."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        config: CompilationConfig | None = None,
        enforce_eager: bool = False,
        lora=None,
    ):
        config = config or CompilationConfig()
        self.model = model
        self.device = device
        self.config = config
        self.level = config.resolved_level(device.type, enforce_eager)
        self.compiled = None
        self.compile_seconds = 0.0
        self.graph_runner: CudaGraphRunner | None = None
        # forwards answered by a CUDA graph replay, and those that ran without one (prefill or mixed steps, batches
        # past the largest graph, graphs off): /metrics' vlserve:cuda_graph_replays_total / _eager_forwards_total
        self.num_graph_replays = 0
        self.num_eager_forwards = 0
        # LoRA (`lora`: the LoRAModelManager): no torch.compile (the adapters' slots change between steps and the
        # layers' kernels are not traced), but CUDA graphs at level >= 2, with the slots as a graph input
        self.lora = lora
        if self.level >= 1 and lora is not None:
            logger.info(
                "LoRA: the decoder runs without torch.compile%s",
                "; decode steps replay CUDA graphs" if self.uses_cuda_graphs else "",
            )
        if self.level >= 1 and lora is None:
            self.cache_dir = use_compile_cache_dir(config.cache_dir or default_compile_cache_dir())
            self.inductor_options = config.inductor_options(device.type)
            self.compiled = torch.compile(
                _own_code(self._decoder_call),
                backend="inductor",
                fullgraph=True,
                options={**self.inductor_options, "guard_filter_fn": keep_input_guards},
            )

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.level >= 2 and self.device.type == "cuda"

    @contextlib.contextmanager
    def eager(self):
        """Run eagerly (no compiled function, no graphs) inside the block."""
        saved = self.compiled, self.graph_runner
        self.compiled, self.graph_runner = None, None
        try:
            yield
        finally:
            self.compiled, self.graph_runner = saved

    def _decoder_call(self, input_ids, positions, inputs_embeds):
        # traced by dynamo: no caches, no metadata (the attention op takes them from attention_step)
        return self.model(input_ids, positions, None, None, inputs_embeds=inputs_embeds)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        step = StepInputs(input_ids, positions, md, inputs_embeds)
        if self.graph_runner is not None:
            hidden = self.graph_runner.try_replay(step)
            if hidden is not None:
                self.num_graph_replays += 1
                return hidden
        self.num_eager_forwards += 1
        return self.run(step, kv_caches)

    def run(self, step: StepInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One forward without graphs: eager, or the compiled function (what a CUDA graph captures)."""
        if self.compiled is None:
            return self.model(
                step.input_ids, step.positions, kv_caches, step.metadata, inputs_embeds=step.inputs_embeds
            )
        torch._dynamo.maybe_mark_dynamic(step.input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(step.positions, step.positions.dim() - 1)
        if step.inputs_embeds is not None:
            torch._dynamo.maybe_mark_dynamic(step.inputs_embeds, 0)
        # dynamo reads `freezing` from inductor's global config while it traces (to keep the weights as constants
        # rather than graph inputs), not from the compile options: set it around the call, not process-wide (by
        # hand: `config.patch` costs ~25 us a step more)
        config = torch._inductor.config
        saved = config.freezing
        config.freezing = self.inductor_options.get("freezing", False)
        try:
            with attention_step(step.metadata, kv_caches):
                return self.compiled(step.input_ids, step.positions, step.inputs_embeds)
        finally:
            config.freezing = saved

    def timed_warm_up(self, run_dummy_steps) -> None:
        """Compile now rather than on the first requests: `run_dummy_steps()` pushes a prefill and a decode through
        `self`; logs how long that took."""
        if self.compiled is None:
            return
        t0 = time.perf_counter()
        run_dummy_steps()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.compile_seconds = time.perf_counter() - t0
        logger.info(
            "torch.compile (level %d) of the decoder took %.1f s (cache: %s)",
            self.level,
            self.compile_seconds,
            self.cache_dir,
        )

    def capture_cuda_graphs(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        mrope: bool,
    ) -> None:
        """Capture decode graphs for the configured batch sizes over these KV caches (CUDA, level >= 2 only)."""
        self.graph_runner = None
        if not self.uses_cuda_graphs:
            return
        sizes = self.config.cudagraph_capture_sizes or default_capture_sizes(max_num_seqs)
        max_blocks = -(-max_model_len // block_size)
        buffers = DecodeBuffers(max(sizes), max_blocks, block_size, mrope, self.device)
        decoder = decoder_of(self.model)
        if self.lora is not None:
            self.lora.enable_graph_slots(max(sizes))
        runner = CudaGraphRunner(
            lambda step: self.run(step, kv_caches), buffers, sizes, max_model_len, aux_source=decoder, lora=self.lora
        )
        runner.capture()
        self.graph_runner = runner
