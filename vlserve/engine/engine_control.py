"""Control calls from the asyncio front end into the engine core (LoRA adapters, encoder-cache eviction), and the
thread hops they share with requests.

`AsyncLLM.add_lora` / `remove_lora` queue a `Control` on the engine thread's inbox, in order with adds and aborts;
in process the engine thread calls the core's method (`EngineCore.add_lora`, ...), with the core in another process
(`MPAsyncLLM`) the dispatcher sends a `core_messages.ControlCall` to every engine and settles the caller's future
once each `ControlAck` is back. Errors (a bad adapter: ValueError) reach the caller as raised by the core.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CONTROL_OPS = ("add_lora", "remove_lora", "evict_encoder_items")  # the EngineCore methods a control call may run


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shutdown, or a fatal error); no more requests are accepted."""


@dataclass
class Control:
    """One control call: `EngineCore.<op>(arg)`, its result for the caller's future `done` on `loop`."""

    op: str
    arg: Any
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future = field(repr=False)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> bool:
    """call_soon_threadsafe that tolerates a caller's loop having closed (False then)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # "Event loop is closed": nobody is listening any more
        return False


def _settle(fut: asyncio.Future, err: BaseException | None, result: Any = None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(result)
    else:
        fut.set_exception(err)


def settle_control(msg: Control, err: BaseException | None, result: Any = None) -> None:
    """Hand a control call's outcome to its caller (from any thread)."""
    _post(msg.loop, _settle, msg.done, err, result)


class ControlCalls:
    """`AsyncLLM`'s control API (mixed in): it needs `_inbox`, `_dead` and `engine` (the core, or its stand-in)."""

    async def add_lora(self, lora_request) -> bool:
        """Load a LoRA adapter into the engine(s) now (ValueError: LoRA off, a bad adapter directory, an id in use
        by another adapter); False when it was loaded already."""
        return await self._control("add_lora", lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter (False when the engine did not hold it)."""
        return await self._control("remove_lora", lora_int_id)

    async def evict_encoder_items(self, mm_hashes: list[str]) -> int:
        """Drop these items' embeddings from the encoder cache(s) where no request references them (a closed video
        session's); returns how many were dropped (of the last engine to answer, with several)."""
        return await self._control("evict_encoder_items", list(mm_hashes))

    async def _control(self, op: str, arg: Any) -> Any:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running ({self._dead})")
        loop = asyncio.get_running_loop()
        msg = Control(op, arg, loop, loop.create_future())
        self._inbox.put(msg)
        return await msg.done

    def _do_control(self, msg: Control) -> None:
        """On the engine thread, the core in this process: run the call now (an adapter load starts now and is
        settled between steps when it ends, so running requests keep stepping)."""
        if msg.op == "add_lora":
            self.engine.add_lora_async(msg.arg, lambda err, result: settle_control(msg, err, result))
            return
        try:
            result = getattr(self.engine, msg.op)(msg.arg)
        except Exception as e:
            settle_control(msg, e)
            return
        settle_control(msg, None, result)
