"""The engine core's LoRA adapters: those registered on every rank, and those loading there off the step loop.

A request naming an adapter the ranks do not hold starts its load (`begin`) and waits in the scheduler's queue;
each rank reads the files on a background thread (`Worker.start_lora_load`). Between steps the core `poll`s the
ranks (`Worker.finished_lora_loads`); once every rank has answered, the adapter is registered and its requests
run, or it failed and they end "abort" with its error. Running requests keep stepping meanwhile. What can be
checked at once (LoRA on, the id not taken by another adapter, the files present, the config valid, the rank
within max_lora_rank) is a ValueError at `begin`, so a bad request is refused when it is added.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlserve.lora.peft_checkpoint import check_adapter_dir

Done = Callable[[BaseException | None, Any], None]  # (error, result): how a control call learns the outcome


@dataclass
class _Load:
    request: Any  # the LoRARequest
    results: dict[int, str | None] = field(default_factory=dict)  # rank -> None (held) or its error
    waiters: list[Done] = field(default_factory=list)


class LoRALoads:
    """Registered adapters (`lora_int_id` -> LoRARequest) and loads under way, for one EngineCore."""

    def __init__(self, executor, scheduler, max_lora_rank: int) -> None:
        self.executor, self.scheduler, self.max_lora_rank = executor, scheduler, max_lora_rank
        self.registered: dict[int, Any] = {}
        self.loading: dict[int, _Load] = {}
        self._errors: dict[int, str] = {}  # the last failed load per id, for `wait`

    def begin(self, lora_request, on_done: Done | None = None) -> bool:
        """Start loading an adapter on every rank; False (and `on_done(None, False)` at once) when it is registered,
        True when a load runs or was running (`on_done` then fires when it ends). ValueError: its id belongs to
        another adapter, or the directory fails the quick checks."""
        lora_id = lora_request.lora_int_id
        load = self.loading.get(lora_id)
        known = self.registered.get(lora_id) or (load.request if load else None)
        if known is not None and (known.lora_name, known.lora_path) != (lora_request.lora_name, lora_request.lora_path):
            raise ValueError(
                f"lora_int_id {lora_id} is {known.lora_name!r} ({known.lora_path}); "
                f"{lora_request.lora_name!r} needs its own id"
            )
        if lora_id in self.registered:
            if on_done is not None:
                on_done(None, False)
            return False
        if load is None:
            check_adapter_dir(lora_request.lora_path, self.max_lora_rank)
            self.executor.collective_rpc("start_lora_load", lora_request)
            load = self.loading[lora_id] = _Load(lora_request)
            self.scheduler.loras_loading.add(lora_id)
        if on_done is not None:
            load.waiters.append(on_done)
        return True

    def poll(self) -> None:
        """Collect the loads the ranks finished; settle those every rank has answered."""
        if not self.loading:
            return
        per_rank = self.executor.collective_rpc("finished_lora_loads")
        for rank, finished in enumerate(per_rank):
            for lora_id, error in finished.items():
                if lora_id in self.loading:
                    self.loading[lora_id].results[rank] = error
        for lora_id, load in list(self.loading.items()):
            if len(load.results) < len(per_rank):
                continue
            del self.loading[lora_id]
            error = next((e for e in load.results.values() if e), None)
            if error is None:
                self.registered[lora_id] = load.request
                self.scheduler.loras_loading.discard(lora_id)
            else:
                error = f"LoRA adapter {load.request.lora_name!r}: {error}"
                self._errors[lora_id] = error
                self.executor.collective_rpc("remove_lora", lora_id)  # ranks that read it drop it again
                self.scheduler.fail_lora(lora_id, error)
            for done in load.waiters:
                done(None if error is None else ValueError(error), True)

    def wait(self, lora_id: int, poll_seconds: float = 0.002) -> str | None:
        """Poll until the adapter's load ends (the synchronous `EngineCore.add_lora`); its error, or None."""
        self._errors.pop(lora_id, None)
        while lora_id in self.loading:
            self.poll()
            if lora_id in self.loading:
                time.sleep(poll_seconds)
        return self._errors.pop(lora_id, None)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (registered or loading) on every rank; False if unknown. Requests still running with
        it reload it from its path; requests waiting for its load end with an error."""
        load = self.loading.pop(lora_int_id, None)
        if load is None and self.registered.pop(lora_int_id, None) is None:
            return False
        self.executor.collective_rpc("remove_lora", lora_int_id)
        if load is not None:
            self.scheduler.fail_lora(lora_int_id, f"LoRA adapter {load.request.lora_name!r} was unloaded")
            for done in load.waiters:
                done(ValueError("the adapter was unloaded while it loaded"), None)
        return True
