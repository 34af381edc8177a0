"""Sampled tokens left on the device until the engine folds the step back (async scheduling), and the next step's
input ids filled from them there.

Under async scheduling the engine plans step N+1 while step N runs. With `ModelRunner.defer_readback` on, step N
returns once its sampling is queued: the sampled ids stay on the device, a non_blocking copy of them heads for a
pinned host buffer, and each sampled request's token list gets a placeholder (`PENDING_TOKEN`). Step N+1's input ids
are written on the host with those placeholders and then filled on the device from step N's ids
(`DeviceTokenFeed.fill`), so the host prepares step N+1 while the device still runs step N, instead of waiting for
N's tokens first. `StepHandle.output()` (the engine, when it folds step N back) waits for the copy, writes the real
ids over the placeholders and completes the `ModelRunnerOutput`.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vlserve.core.sched_output import ModelRunnerOutput
from vlserve.kernels.host_copy import tensor_to_device
from vlserve.worker.request_state import CachedRequestState
from vlserve.worker.sample_step import logprob_lists

PENDING_TOKEN = -1  # a sampled token still on the device, in a CachedRequestState's token_ids


class StepHandle:
    """One launched step. `output()` returns its ModelRunnerOutput, reading deferred samples back first (once: by the
    engine when it folds the step back, or earlier by the runner when a later step needs the real ids on the
    host). Launch and read-back run on the engine's one thread."""

    def __init__(self, out: ModelRunnerOutput):
        self._out = out  # its step_seconds: the launch's, plus the read-back's wait when deferred
        self.tokens: torch.Tensor | None = None  # [S] int64 on the device while deferred
        self._states: list[CachedRequestState] = []  # the sampled requests, in `tokens` order
        self._positions: list[int] = []  # where each one's placeholder sits in its token_ids
        self._rows: list[int] = []  # each one's index in out.req_ids
        self._host: tuple[torch.Tensor, ...] = ()  # the ids (and logprob tensors) on their way to the host
        self._copied: torch.cuda.Event | None = None  # recorded after those copies (CUDA)

    def output(self) -> ModelRunnerOutput:
        """The step's output with its sampled ids on the host (waits for the device if they are not yet)."""
        if self._states:
            self._read_back()
        return self._out

    def _read_back(self) -> None:
        t0 = time.perf_counter()
        if self._copied is not None:
            self._copied.synchronize()
        ids = self._host[0].tolist()
        sampled = self._out.sampled_token_ids
        for state, pos, row, tok in zip(self._states, self._positions, self._rows, ids):
            state.token_ids[pos] = tok
            sampled[row] = [tok]
        if len(self._host) > 1:  # logprobs: one row per request
            ones = [1] * len(ids)
            self._out.logprobs = logprob_lists(self._states, ones, ones, *(t.tolist() for t in self._host[1:]))
        self._states, self._host, self._copied = [], (), None
        self._out.step_seconds += time.perf_counter() - t0  # (not the time between: other steps ran in it)


class DeviceTokenFeed:
    """The runner's half: defers a step's samples (`defer`) and fills the next step's placeholders (`fill`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.num_fed_tokens = 0  # input ids taken on the device from an earlier step's samples (tests, benches)

    def defer(
        self,
        handle: StepHandle,
        states: list[CachedRequestState],
        rows: list[int],
        tokens: torch.Tensor,
        logprobs: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        """Leave `tokens` ([S] int64, states[i]'s sampled id at i; `logprobs`: the sampler's [S]-row logprob
        tensors) on the device: start their copies to the host and put a placeholder at the end of each state's
        token ids."""
        handle.tokens = tokens
        # (non_blocking into pinned memory from torch's caching host allocator, which keeps it until the copy ran)
        handle._host = tuple(t.to("cpu", non_blocking=True) for t in (tokens, *(logprobs or ())))
        if self.device.type == "cuda":
            handle._copied = torch.cuda.Event()
            handle._copied.record()
        handle._rows = rows
        handle._positions = [len(state.token_ids) for state in states]
        for i, state in enumerate(states):
            state.token_ids.append(PENDING_TOKEN)
            state.pending_sample = (handle, i)
        handle._states = list(states)

    def fill(
        self,
        input_ids: torch.Tensor,
        ids_np: np.ndarray,
        positions_np: np.ndarray,
        cu: np.ndarray,
        states: list[CachedRequestState],
    ) -> None:
        """Write each placeholder among the step's input ids (`ids_np` [T] on the host, `input_ids` [T] the tensor
        the model reads) from the sampled ids it stands for, on the device. `positions_np` [T]: each row's token
        position; cu [B + 1]: the requests' row offsets (states in batch order)."""
        holes = np.flatnonzero(ids_np < 0)  # [K] rows whose token is still on the device
        k = len(holes)
        if not k:
            return
        owners = np.searchsorted(cu, holes, side="right") - 1  # [K] each hole's request
        first = states[owners[0]].pending_sample[0]
        if holes[-1] == k - 1 and owners[-1] == k - 1 and first._states[:k] == states[:k]:
            # the usual decode step: rows 0..k-1 are requests 0..k-1, which the step before sampled first, in order
            if not np.array_equal(first._positions[:k], positions_np[:k]):
                raise RuntimeError("a decode step's placeholders are not its requests' latest samples")
            input_ids[:k].copy_(first.tokens[:k])
        else:
            groups: dict[StepHandle, tuple[list[int], list[int]]] = {}  # (rows to fill, indices into its tokens)
            for hole, owner in zip(holes.tolist(), owners.tolist()):
                handle, i = states[owner].pending_sample
                if handle._positions[i] != positions_np[hole]:
                    raise RuntimeError(
                        f"request {states[owner].req_id}: a placeholder at position "
                        f"{positions_np[hole]} is not its latest sample's ({handle._positions[i]})"
                    )
                dst, src = groups.setdefault(handle, ([], []))
                dst.append(hole)
                src.append(i)
            for handle, (dst, src) in groups.items():
                picked = handle.tokens.index_select(0, tensor_to_device(src, torch.long, self.device))
                input_ids.index_copy_(0, tensor_to_device(dst, torch.long, self.device), picked)
        self.num_fed_tokens += k

    @staticmethod
    def read_back_pending(states: list[CachedRequestState]) -> None:
        """Make the real ids of these requests' deferred samples known on the host (penalties read them)."""
        for state in states:
            pending = state.pending_sample
            if pending is not None:
                pending[0].output()
