"""The engine core's view of one request (pure Python)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class EngineCoreRequest:
    """What the front end hands to the engine core: token ids, media, params (plain data)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # The LoRA adapter to run with: a vlserve.lora.LoRARequest (plain data; core reads only lora_int_id), None: base
    lora_request: Any = None
    priority: int = 0  # scheduling policy "priority": lower runs first (ties by arrival_time)
    cache_salt: str | None = None  # enters the first block's prefix-cache hash: only equal salts share KV blocks
    pools: bool = False  # a pooling request: prefill only, it ends when its prompt is computed (no token sampled)


class Request:
    """Mutable per-request state owned by the scheduler.

    The one rule: each step `num_computed_tokens` catches up toward `num_tokens_with_spec`.
    """

    def __init__(self, req: EngineCoreRequest, max_tokens: int):
        self.request_id = req.request_id
        self.prompt_token_ids = req.prompt_token_ids
        self.sampling_params = req.sampling_params
        self.arrival_time = req.arrival_time
        self.mm_features = req.mm_features
        self.lora_request = req.lora_request
        self.priority = req.priority
        self.cache_salt = req.cache_salt
        self.pools = req.pools
        self.kv_transfer_params = req.sampling_params.kv_transfer_params  # KV transfer (kv_transfer/p2p), or None
        self.max_tokens = max_tokens  # resolved: min(params.max_tokens, max_model_len - prompt_len)
        self.stop_token_ids = req.sampling_params.all_stop_token_ids()
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # sampled in a step still in flight (async scheduling), not yet known
        self.num_tokens_sent = 0  # pipeline parallel: the leading tokens every stage's runner holds
        self.num_cached_tokens = -1  # prefix-cache hit length at first schedule; -1 = not scheduled yet
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []  # chained hashes of full blocks, grown lazily by the KV manager
        self.block_keys: list[bytes] = []  # stable keys of full blocks (KV connectors only: kv_transfer)
        # Kept by the KV cache manager for the decode fast path: the tokens (lookahead included) its blocks hold
        # room for, and the most known tokens before a full block waits to be registered for prefix reuse
        self.kv_token_capacity = 0
        self.kv_registered_limit = -1
        # The output constraint's matcher (a StructuredOutputRequest, duck-typed: the scheduler only calls
        # is_ready / error / accept_tokens / validate_tokens / is_terminated); None when unconstrained.
        self.structured_output = None
        # Where the output's reasoning ends (a vlserve.reasoning.ReasoningTracker) when the engine has a reasoning
        # parser and the request has a grammar or a thinking budget; None otherwise.
        self.reasoning = None
        self.plain_output = False  # set by the scheduler on admission: see Scheduler.add_request

    @property
    def lora_int_id(self) -> int:
        """The adapter's id inside the engine (0: the base model)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def finishes_in_flight(self, max_model_len: int) -> bool:
        """Whether the tokens already in flight end the request by length for sure (no step is scheduled then)."""
        n = self.num_output_placeholders
        return len(self.output_token_ids) + n >= self.max_tokens or len(self.all_token_ids) + n >= max_model_len

    def accept_token(self, tok: int, max_model_len: int) -> bool:
        """Append one sampled token (whatever the limits: it was computed) and set the finished status when it is a
        stop token (once min_tokens are out) or reaches max_tokens or max_model_len. Returns whether it finished."""
        n_out, n_all = len(self.output_token_ids), len(self.all_token_ids)
        self.output_token_ids.append(tok)
        self.all_token_ids.append(tok)
        stop_ids = self.stop_token_ids
        if stop_ids and tok in stop_ids and n_out + 1 >= self.sampling_params.min_tokens:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = None if tok in self.sampling_params._eos_token_ids else tok
            return True
        if self.max_tokens - n_out <= 1 or max_model_len - n_all <= 1:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def accept_sampled(self, sampled: list[int], max_model_len: int) -> list[int]:
        """Append the sampled tokens up to the first stop: a stop token (once min_tokens are out), max_tokens or
        max_model_len, setting the finished status. Returns the tokens kept. One pass: the length limit is a count,
        only stop-token membership is checked per token."""
        if len(sampled) == 1:  # the usual step
            self.accept_token(sampled[0], max_model_len)
            return [sampled[0]]
        n_out = len(self.output_token_ids)
        # Tokens that fit before a length limit ends the request (the first token is always appended).
        room = max(min(self.max_tokens - n_out, max_model_len - len(self.all_token_ids)), 1)
        keep = min(len(sampled), room)
        stop_ids = self.stop_token_ids
        if stop_ids:
            min_tokens = self.sampling_params.min_tokens
            for i in range(keep):
                tok = sampled[i]
                if tok in stop_ids and n_out + i + 1 >= min_tokens:
                    kept = sampled[: i + 1]
                    self.output_token_ids.extend(kept)
                    self.all_token_ids.extend(kept)
                    self.status = RequestStatus.FINISHED_STOPPED
                    self.stop_reason = None if tok in self.sampling_params._eos_token_ids else tok
                    return kept
        kept = sampled[:keep]  # a copy: the runner's list is not shared
        self.output_token_ids.extend(kept)
        self.all_token_ids.extend(kept)
        if keep >= room:
            self.status = RequestStatus.FINISHED_LENGTH
        return kept

    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
