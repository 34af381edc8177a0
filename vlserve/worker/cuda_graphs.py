"""CUDA graphs for decode steps: persistent input buffers, padding to captured batch-size buckets, capture, replay.

A decode-only step of B sequences (one query token each) is padded to the smallest captured bucket >= B: its
tensors are copied into buffers that live as long as the graphs (token ids, positions incl. M-RoPE's 3 rows, slot
mapping, block tables, sequence lengths), and the padding rows get token 0 at position 0, slot -1 (the KV write
skips it: nothing is written) and a sequence length of 1 (they read one cached key and their rows are dropped).
Steps with prefill tokens, drafts to verify, media embeddings (decode tokens are never media placeholders), or more
sequences than the largest bucket run without a graph.

With LoRA, the adapters' per-token slots are one more graph input: the manager's persistent slot buffer
(`LoRAModelManager.graph_slots`), filled before each replay with the step's slots and -1 on the padding rows; the
graphs are captured under `graph_step`, where every LoRA layer launches its delta whatever the adapters loaded then.

`DecodeBuffers` (loading and padding) is plain torch and runs on any device: on CPU the tests push padded batches
through the same forward the graphs capture. `CudaGraphRunner` captures and replays (CUDA only); built with
`use_graphs=False` it pads and runs the forward eagerly instead of replaying (the device-independent check).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlserve.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One flattened step as the decoder takes it."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] or [3, T] int64
    metadata: AttentionMetadata
    inputs_embeds: torch.Tensor | None = None  # [T, H] when media were merged before the decoder


def is_graphable(step: StepInputs) -> bool:
    """Whether a graph can run this step: decode tokens only, no media embeddings."""
    md = step.metadata
    return step.inputs_embeds is None and md.num_decodes == md.num_seqs and md.max_query_len == 1


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest size >= num_seqs (sizes sorted ascending), or None when num_seqs is above them all."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeBuffers:
    """Persistent decode inputs for up to `max_seqs` sequences of up to `max_blocks` KV blocks each."""

    def __init__(self, max_seqs: int, max_blocks: int, block_size: int, mrope: bool, device: torch.device):
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks
        self.block_size = block_size
        with torch.inference_mode(False):  # normal tensors, as the step buffers are: one dynamo guard for both
            self._allocate(max_seqs, max_blocks, mrope, device)

    def _allocate(self, max_seqs: int, max_blocks: int, mrope: bool, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_seqs, dtype=torch.long, device=device)  # [S]
        self.positions = torch.zeros(
            (3, max_seqs) if mrope else (max_seqs,), dtype=torch.long, device=device
        )  # [S] or [3, S]
        self.slot_mapping = torch.full((max_seqs,), -1, dtype=torch.long, device=device)  # [S]
        self.seq_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)  # [S]
        self.block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)  # [S, M]
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)  # [S + 1], fixed

    def view(self, bucket: int, seq_lens_cpu: list[int], workspace: torch.Tensor | None = None) -> StepInputs:
        """The first `bucket` rows of every buffer as a decode step (`seq_lens_cpu` as the host copy; a graph is
        captured with the longest length it may meet, since the Triton decode sizes its splits from it)."""
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            num_decodes=bucket,
            max_query_len=1,
            max_seq_len=max(seq_lens_cpu),
            query_start_loc_cpu=list(range(bucket + 1)),
            seq_lens_cpu=seq_lens_cpu,
            workspace=workspace,
        )
        return StepInputs(self.input_ids[:bucket], self.positions[..., :bucket], md)

    def load(self, step: StepInputs, bucket: int) -> StepInputs:
        """Copy a decode step of B <= bucket sequences into the buffers and pad rows B..bucket; returns the
        padded step (views of the buffers)."""
        md = step.metadata
        b = md.num_seqs
        if not is_graphable(step) or b > bucket or bucket > self.max_seqs:
            raise ValueError(
                f"cannot pad a step of {b} sequences (decode only: {is_graphable(step)}) "
                f"to a bucket of {bucket} (buffers hold {self.max_seqs})"
            )
        width = md.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"block table of {width} blocks exceeds the buffers' {self.max_blocks}")
        self.input_ids[:b].copy_(step.input_ids, non_blocking=True)
        self.positions[..., :b].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:b].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(md.seq_lens, non_blocking=True)
        self.block_tables[:b, :width].copy_(md.block_tables, non_blocking=True)
        if bucket > b:  # padding rows: token 0 at position 0, nothing written, one key read from block 0
            self.input_ids[b:bucket].zero_()
            self.positions[..., b:bucket].zero_()
            self.slot_mapping[b:bucket].fill_(-1)
            self.seq_lens[b:bucket].fill_(1)
            self.block_tables[b:bucket].zero_()
        return self.view(bucket, list(md.seq_lens_cpu) + [1] * (bucket - b), md.workspace)


class CudaGraphRunner:
    """Captures `forward(step) -> hidden [T, H]` once per bucket size and replays it for decode steps."""

    def __init__(
        self,
        forward: Callable[[StepInputs], torch.Tensor],
        buffers: DecodeBuffers,
        sizes: list[int],
        max_seq_len: int,
        aux_source=None,
        use_graphs: bool = True,
        lora=None,
    ):
        self.forward = forward
        self.lora = lora  # the LoRAModelManager whose slot buffer the graphs read, or None
        self.use_graphs = use_graphs
        self.buffers = buffers
        self.sizes = sorted(n for n in sizes if n <= buffers.max_seqs)
        self.max_seq_len = max_seq_len
        self.aux_source = aux_source  # the decoder, when it keeps aux hidden states (EAGLE) per forward
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> hidden [bucket, H] written by each replay
        self.aux_outputs: dict[int, list[torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def capture(self, show_progress: bool = True) -> None:
        """Capture every bucket, largest first, in one shared memory pool (runs each once eagerly to warm up)."""
        from tqdm.auto import tqdm

        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        sizes = sorted(self.sizes, reverse=True)
        for bucket in tqdm(sizes, desc="Capturing CUDA graphs", disable=not show_progress):
            step = self.buffers.view(bucket, [self.max_seq_len] * bucket)
            with self._lora_graph_step(bucket):
                self.forward(step)  # warm-up: compiles this shape class, autotunes, allocates lazily built state
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bucket] = self.forward(step)
            self.graphs[bucket] = graph
            if self.aux_source is not None and self.aux_source.aux_hidden_state_layers:
                self.aux_outputs[bucket] = list(self.aux_source.aux_hidden_states)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1f s", len(sizes), self.sizes, self.capture_seconds)

    def _lora_graph_step(self, bucket: int):
        return contextlib.nullcontext() if self.lora is None else self.lora.graph_step(bucket)

    def try_replay(self, step: StepInputs) -> torch.Tensor | None:
        """hidden [B, H] from a replay, or None when no captured graph fits this step."""
        if (self.use_graphs and not self.graphs) or not is_graphable(step):
            return None
        bucket = bucket_for(step.metadata.num_seqs, self.sizes)
        if bucket is None or step.metadata.block_tables.shape[1] > self.buffers.max_blocks:
            return None
        padded = self.buffers.load(step, bucket)
        b = step.metadata.num_seqs
        if self.lora is not None:
            self.lora.load_graph_slots(b, bucket)  # this step's adapter slots, -1 on the padding rows
        if not self.use_graphs:
            with self._lora_graph_step(bucket):  # what a replay reads: the slot buffer, every layer's delta on
                return self.forward(padded)[:b]
        self.graphs[bucket].replay()
        if bucket in self.aux_outputs:
            self.aux_source.aux_hidden_states = [t[:b] for t in self.aux_outputs[bucket]]
        return self.outputs[bucket][:b]
