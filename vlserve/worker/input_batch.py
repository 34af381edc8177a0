"""The runner's step inputs, built in persistent host buffers and copied to the device once per buffer per step.

Block-table rows live here between steps (one row per tracked request, grown by the step's new block ids only);
token ids, positions, slot mapping, query_start_loc and seq_lens are written with vectorised numpy into buffers
allocated once (pinned on CUDA, so each becomes one non_blocking copy into a persistent device buffer). On CPU the
model reads the host buffers directly: no tensor is created per request or per step.

On CUDA a buffer's copy may still be in flight when the next step is prepared (steps that sample nothing, such as
consecutive prefill chunks, never synchronize with the device), so each buffer records an event after its copy and
`prepare` waits for it before writing the host side again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlserve.kernels.metadata import AttentionMetadata


@dataclass
class StepInputs:
    """One step's flattened batch: per-request arrays ([B], decodes first) and the device tensors the model reads."""

    req_ids: list[str]
    q_lens: np.ndarray  # [B] int64 query tokens this step
    starts: np.ndarray  # [B] int64 computed tokens before this step
    seq_lens: np.ndarray  # [B] int64 context after this step
    cu: np.ndarray  # [B + 1] int64 query start offsets
    positions_np: np.ndarray  # [T] int64 (a view of a persistent buffer: valid until the next step)
    input_ids_np: np.ndarray  # [T] int64, the host side of input_ids (likewise)
    input_ids: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        return int(self.cu[-1])


class _HostDeviceBuffer:
    """A flat host buffer (pinned when the device is CUDA) with, off CPU, a twin on the device."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.device, self.dtype = device, dtype
        self._allocate(numel)

    def _allocate(self, numel: int) -> None:
        on_cuda = self.device.type == "cuda"
        with torch.inference_mode(False):
            self.host = torch.zeros(numel, dtype=self.dtype, pin_memory=on_cuda)
            self.dev = None if self.device.type == "cpu" else torch.zeros(numel, dtype=self.dtype, device=self.device)
        self.np = self.host.numpy()
        self._views: dict[tuple, torch.Tensor] = {}  # CPU: (numel, shape) -> the view of `host` handed out
        self.copied = torch.cuda.Event() if on_cuda else None  # recorded after each copy out of `host`
        self.copy_pending = False

    def wait_for_copy(self) -> None:
        """Block until the last copy out of the host buffer has read it (before the host side is written again)."""
        if self.copy_pending:
            self.copied.synchronize()
            self.copy_pending = False

    def ensure(self, numel: int) -> None:
        """Grow (doubling) to hold numel elements; the contents are not kept. Waits for a pending copy first, so
        the host side may be written afterwards."""
        self.wait_for_copy()
        if numel > self.np.shape[0]:
            self._allocate(max(numel, 2 * self.np.shape[0]))

    def to_device(self, numel: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The first numel elements on the device (one non_blocking copy off CPU), viewed as shape."""
        if self.dev is None:  # the model reads the host buffer: the same view as last time, most steps
            key = (numel, shape)
            out = self._views.get(key)
            if out is None:
                if len(self._views) > 64:
                    self._views.clear()
                out = self._views[key] = self.host[:numel] if shape is None else self.host[:numel].view(shape)
            return out
        out = self.dev[:numel]
        out.copy_(self.host[:numel], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
            self.copy_pending = True
        return out if shape is None else out.view(shape)


def step_token_ids(spec: dict[str, list[int]], states, starts: np.ndarray, q_lens: np.ndarray, all_decodes: bool):
    """The step's input ids, request after request: its known tokens, then its scheduled drafts past them (`spec`:
    the drafts per request id)."""
    if all_decodes and not spec:  # one known token each
        return [state.token_ids[s] for state, s in zip(states, starts.tolist())]
    ids: list[int] = []
    for state, s, n in zip(states, starts.tolist(), q_lens.tolist()):
        window = state.token_ids[s : s + n]
        if len(window) < n:  # speculative tokens beyond the known ones
            window += spec[state.req_id][: n - len(window)]
        ids += window
    return ids


class InputBatch:
    """Persistent block tables per request (one per KV cache group) and the per-step input buffers of a
    ModelRunner. `layer_groups[l]`: decoder layer l's KV cache group (None: a single group)."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        max_num_tokens: int = 2048,
        max_num_reqs: int = 64,
        max_blocks_per_req: int = 32,
        layer_groups: tuple[int, ...] | None = None,
    ):
        self.block_size = block_size
        self.device = device
        self.layer_groups = layer_groups
        self.num_groups = 1 if layer_groups is None else max(layer_groups) + 1
        G = self.num_groups
        self.rows: dict[str, int] = {}  # req_id -> row of the persistent block tables
        self.free_rows: list[int] = list(range(max_num_reqs - 1, -1, -1))
        self._last_rows: tuple[list[str], np.ndarray] | None = None  # the last step's req_ids and their rows
        self.block_table = np.zeros((G, max_num_reqs, max_blocks_per_req), dtype=np.int32)  # [G, R, W]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # [R] (every group holds as many)
        self.input_ids = _HostDeviceBuffer(max_num_tokens, torch.int64, device)
        self.positions = _HostDeviceBuffer(max_num_tokens, torch.int64, device)
        self.query_start_loc = _HostDeviceBuffer(max_num_reqs + 1, torch.int32, device)
        self.seq_lens = _HostDeviceBuffer(max_num_reqs, torch.int32, device)
        # per group: the step's slot mapping and block table
        self.slot_mappings = [_HostDeviceBuffer(max_num_tokens, torch.int64, device) for _ in range(G)]
        self.step_block_tables = [
            _HostDeviceBuffer(max_num_reqs * max_blocks_per_req, torch.int32, device) for _ in range(G)
        ]
        self._arange = np.arange(max_num_tokens, dtype=np.int64)

    # -- block tables ------------------------------------------------------------------------------------------
    def add_request(self, req_id: str, block_ids: tuple[list[int], ...]) -> None:
        """Start (or restart, after preemption) a request's block-table rows (`block_ids`: one list per group)."""
        self.remove_request(req_id)
        self._last_rows = None
        if not self.free_rows:
            self._grow_rows()
        row = self.free_rows.pop()
        self.rows[req_id] = row
        self.block_table[:, row] = 0
        self.num_blocks[row] = 0
        self.append_blocks(req_id, block_ids)

    def append_blocks(self, req_id: str, new_block_ids: tuple[list[int], ...]) -> None:
        """Append the step's new block ids (one list per group, all as long; `()`: none) to the request's rows."""
        if not new_block_ids or not new_block_ids[0]:
            return
        row = self.rows[req_id]
        n, k = int(self.num_blocks[row]), len(new_block_ids[0])
        if n + k > self.block_table.shape[2]:
            width = max(n + k, 2 * self.block_table.shape[2])
            self.block_table = np.pad(self.block_table, ((0, 0), (0, 0), (0, width - self.block_table.shape[2])))
        for g, ids in enumerate(new_block_ids):
            self.block_table[g, row, n : n + k] = ids
        self.num_blocks[row] = n + k

    def remove_request(self, req_id: str) -> None:
        row = self.rows.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)
            self._last_rows = None

    def block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group, as the scheduler allocated them."""
        row = self.rows[req_id]
        return tuple(self.block_table[g, row, : self.num_blocks[row]].tolist() for g in range(self.num_groups))

    def _grow_rows(self) -> None:
        old = self.block_table.shape[1]
        self.block_table = np.pad(self.block_table, ((0, 0), (0, old), (0, 0)))
        self.num_blocks = np.pad(self.num_blocks, (0, old))
        self.free_rows.extend(range(2 * old - 1, old - 1, -1))

    # -- one step ----------------------------------------------------------------------------------------------
    def prepare(
        self,
        req_ids: list[str],
        token_ids: list[int],
        q_lens: np.ndarray,
        starts: np.ndarray,
        workspace: torch.Tensor | None,
    ) -> StepInputs:
        """Fill the step buffers. req_ids: decodes first; token_ids: the step's input ids, request i's q_lens[i]
        after those of the requests before it; starts[i]: its computed tokens before the step."""
        B = len(req_ids)
        seq_lens = starts + q_lens  # [B]
        T = int(q_lens.sum())
        all_decodes = T == B  # one token each (q_lens >= 1)
        if all_decodes:
            cu = np.arange(B + 1, dtype=np.int64)
        else:
            cu = np.zeros(B + 1, dtype=np.int64)
            np.cumsum(q_lens, out=cu[1:])
        if T > self._arange.shape[0]:
            self._arange = np.arange(max(T, 2 * self._arange.shape[0]), dtype=np.int64)
        for buf in (self.input_ids, self.positions, *self.slot_mappings):
            buf.ensure(T)  # (after the previous step's copy out of it has read it)
        for buf in (self.query_start_loc, self.seq_lens):
            buf.ensure(B + 1)

        ids = self.input_ids.np[:T]
        ids[:] = token_ids
        # positions[t] = start of its request + offset within the request's chunk
        positions = self.positions.np[:T]
        if all_decodes:
            req_index = self._arange[:B]  # [T] (T == B)
            positions[:] = starts
        else:
            req_index = np.repeat(self._arange[:B], q_lens)  # [T]
            np.add(self._arange[:T] - cu[:-1][req_index], starts[req_index], out=positions)
        self.query_start_loc.np[: B + 1] = cu
        self.seq_lens.np[:B] = seq_lens

        rows = self._rows_of(req_ids)  # [B]
        M = max(int(self.num_blocks[rows].max()), 1)
        shared = dict(
            query_start_loc=self.query_start_loc.to_device(B + 1),
            seq_lens=self.seq_lens.to_device(B),
            num_decodes=B if all_decodes else int(np.count_nonzero(q_lens == 1)),
            max_query_len=1 if all_decodes else int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=cu.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            workspace=workspace,
        )
        views = []
        for g in range(self.num_groups):
            slots, block_tables = self._group_slots(g, rows, M, req_index, positions)
            views.append(AttentionMetadata(slot_mapping=slots, block_tables=block_tables, **shared))
        md = views[0]  # group 0's: the draft's too
        if self.layer_groups is not None:
            md.layer_views = [views[g] for g in self.layer_groups]
        return StepInputs(
            req_ids=req_ids,
            q_lens=q_lens,
            starts=starts,
            seq_lens=seq_lens,
            cu=cu,
            positions_np=positions,
            input_ids_np=ids,
            input_ids=self.input_ids.to_device(T),
            attn_metadata=md,
        )

    def _rows_of(self, req_ids: list[str]) -> np.ndarray:
        """The block-table rows of req_ids [B] (the last step's array again while no request came or went and the
        order holds, as in most decode steps; read only)."""
        last = self._last_rows
        if last is not None and last[0] == req_ids:
            return last[1]
        rows = np.fromiter(map(self.rows.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))  # [B]
        self._last_rows = (list(req_ids), rows)
        return rows

    def _group_slots(
        self, g: int, rows: np.ndarray, M: int, req_index: np.ndarray, positions: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Group g's step block table `[B, M]` and slot mapping `[T]` (flat KV slots), on the device."""
        B, T = rows.shape[0], positions.shape[0]
        buf = self.step_block_tables[g]
        buf.ensure(B * M)
        table = buf.np[: B * M].reshape(B, M)  # [B, M]
        np.take(self.block_table[g, :, :M], rows, axis=0, out=table)
        bs = self.block_size
        slot_buf = self.slot_mappings[g]
        slots = slot_buf.np[:T]
        np.multiply(table[req_index, positions // bs], bs, out=slots)
        slots += positions % bs
        return slot_buf.to_device(T), buf.to_device(B * M, (B, M))

    def positions_on_device(self, num_tokens: int) -> torch.Tensor:
        """The step's [T] positions on the device (one copy off CPU)."""
        return self.positions.to_device(num_tokens)
