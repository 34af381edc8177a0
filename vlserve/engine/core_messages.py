"""Plain-data messages between the API process and an engine-core process (pickled over pyzmq).

The client pushes `AddRequests` / `AbortRequests` / `FinishStopped` / `ControlCall` / `ShutdownEngine` to one
engine's input socket; every engine pushes `EngineReady` / `EngineFailed` / `AddAck` / `ControlAck` / `StepOutputs`
to the client's one output
socket, each tagged with its `engine_index`, so one client can later drive N engine processes (DP replicas).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from vlserve.core.request import EngineCoreRequest
from vlserve.core.sched_output import EngineCoreOutput

KV_POLL_S = 0.005  # how often an idle engine holding kept KV blocks (a P2P producer) polls its connector


# -- client -> engine -----------------------------------------------------------------------------------------------
@dataclass
class AddRequests:
    """Queue these engine requests (the n sequences of user request `user_request_id`), all or none."""

    user_request_id: str
    requests: list[EngineCoreRequest]


@dataclass
class AbortRequests:
    """Abort these engine request ids (unknown ids are ignored)."""

    request_ids: list[str]


@dataclass
class FinishStopped:
    """Engine request ids the front end's detokenizer stopped on a stop string."""

    request_ids: list[str]


@dataclass
class ControlCall:
    """Run `EngineCore.<op>(arg)` (an op of `engine_control.CONTROL_OPS`: add_lora, remove_lora,
    evict_encoder_items) and answer with a `ControlAck` carrying `call_id`."""

    call_id: int
    op: str
    arg: object


@dataclass
class ShutdownEngine:
    """Leave the loop and exit 0."""


# -- engine -> client -----------------------------------------------------------------------------------------------
@dataclass
class EngineReady:
    """The engine loaded its model: what the front end needs to process inputs for it."""

    engine_index: int
    pid: int
    max_model_len: int
    modalities: tuple[str, ...]
    eos_token_ids: tuple[int, ...]
    metrics: dict[str, float]


@dataclass
class EngineFailed:
    """The engine could not start (bad checkpoint, out of memory...): the error text for the user."""

    engine_index: int
    error: str


@dataclass
class AddAck:
    """The answer to one `AddRequests`: `error` is None when queued, else what the core raised; the core's
    counters after it."""

    engine_index: int
    user_request_id: str
    error: BaseException | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ControlAck:
    """The answer to one `ControlCall`: its result, or the error the core raised; the core's counters after it."""

    engine_index: int
    call_id: int
    result: object = None
    error: BaseException | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class StepOutputs:
    """One engine step's new tokens, and the core's counters after it (also sent after aborts when idle).

    `step_error` is set when the step raised: the engine then dropped every request it held. `fatal`: the engine
    cannot go on (a rank died) and exits right after this message."""

    engine_index: int
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    step_error: str | None = None
    fatal: bool = False


def encode(msg: object) -> bytes:
    """A message as bytes (pickle: tensors of processed media included)."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> object:
    """The inverse of `encode` (only ever fed bytes from our own processes)."""
    return pickle.loads(data)


def portable_error(err: BaseException) -> BaseException:
    """`err` if it survives pickling, else a RuntimeError with its text (so the message can cross)."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
