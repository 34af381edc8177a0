"""Plain-data messages between the scheduler, the model runner and the engine core's output path, and the plan of a
step the scheduler builds them from (`StepPlan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption): everything it needs."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after preemption
    sampling_params: SamplingParams
    mm_features: list[MultiModalFeature]
    block_ids: tuple[list[int], ...]  # per KV cache group
    num_computed_tokens: int
    lora_request: Any = None  # a vlserve.lora.LoRARequest, or None (the base model)


@dataclass(slots=True)
class CachedRequestData:
    """The requests the runner already tracks, as parallel lists (one entry per request): only what changed."""

    req_ids: list[str]
    new_block_ids: list[tuple[list[int], ...]]  # per KV cache group; () when the step adds none
    num_computed_tokens: list[int]
    # Pipeline parallel: each request's tokens from position token_starts[i] (<= what the runner holds) to the end of
    # the step's window, drafts aside, so the stages that do not sample learn the tokens sampled (or accepted)
    # since; None otherwise (the runner sampled them itself)
    new_token_ids: list[list[int]] | None = None
    token_starts: list[int] | None = None

    def __init__(self, with_tokens: bool = False):  # (per step: literals cost less than default factories)
        self.req_ids = []
        self.new_block_ids = []
        self.num_computed_tokens = []
        self.new_token_ids = [] if with_tokens else None
        self.token_starts = [] if with_tokens else None

    def __len__(self) -> int:
        return len(self.req_ids)

    def add(self, req_id: str, new_block_ids: tuple[list[int], ...], num_computed_tokens: int) -> None:
        self.req_ids.append(req_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)


@dataclass
class EncoderSlice:
    """Stages [start, end) of one media item's tower, run this step: an item too big for one step's encoder budget
    is encoded over several steps (`vlserve.encoders.staged`); the runner keeps its partial state by mm_hash, and
    the slice with end == num_stages yields the item's embeddings."""

    mm_hash: str
    item_index: int  # into the request's mm_features
    start: int
    end: int
    num_stages: int


@dataclass
class SchedulerOutput:
    """One step's plan. num_scheduled_tokens counts spec tokens too."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)  # req -> mm_features indices
    finished_req_ids: set[str] = field(default_factory=set)  # finished or preempted since the last step
    # encoder-cache entries the runner drops: evicted ones, and items abandoned mid-encode (their partial state too)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # req -> slices of items encoded over several steps (run even when the request has no token this step)
    scheduled_encoder_slices: dict[str, list[EncoderSlice]] = field(default_factory=dict)
    # Structured outputs: int32 token bitmask [rows, ceil(V / 32)] (bit set = allowed), filled by the engine
    # after planning; per constrained request that samples, its first row (drafts' rows, then the bonus row).
    grammar_bitmask: Any = None  # numpy array or None
    grammar_rows: dict[str, int] = field(default_factory=dict)
    # The KV connector's plan for this step (distributed/kv_transfer: loads before the forward, saves after); None
    # when no connector is configured or it has nothing to do. A step may carry only this (no tokens scheduled).
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        """No token and no encoder slice to run."""
        return self.total_num_scheduled_tokens == 0 and not self.scheduled_encoder_slices


@dataclass(slots=True)
class StepPlan:
    """One schedule() call: the budget it has left and the parts of its SchedulerOutput planned so far."""

    token_budget: int  # tokens left this step
    max_reqs: int  # requests the step may hold (max_num_seqs, or the batch queue's share)
    num_encoding: int  # embeddings the step encodes so far
    preempted: bool  # a running request was preempted: no waiting one is admitted
    loras: set[int]  # the adapters of the step's requests (at most max_loras)
    num_scheduled: dict[str, int]
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    spec_tokens: dict[str, list[int]]
    encoder_inputs: dict[str, list[int]]
    encoder_slices: dict[str, list[EncoderSlice]]

    def __init__(self, token_budget: int, max_reqs: int, send_token_ids: bool = False):  # (literals: see above)
        self.token_budget = token_budget
        self.max_reqs = max_reqs
        self.num_encoding = 0
        self.preempted = False
        self.loras = set()
        self.num_scheduled = {}
        self.new_reqs = []
        self.cached_reqs = CachedRequestData(send_token_ids)
        self.spec_tokens = {}
        self.encoder_inputs = {}
        self.encoder_slices = {}


@dataclass
class ModelRunnerOutput:
    """What the runner computed: per scheduled request, the tokens it sampled (empty for a partial prefill)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request with logprobs: list (per sampled token) of (token_ids, logprobs, sampled_rank).
    logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # next drafts, when spec decode is on
    # Timings (wall seconds, device work included) the engine sizes the per-step encoder budget from.
    encoder_seconds: float = 0.0  # in the encoder calls
    num_encoded_embeds: int = 0  # embeddings those calls produced
    step_seconds: float = 0.0  # the whole execute_model call
    kv_connector_output: Any = None  # a kv_transfer KVConnectorOutput (loads / saves that ended), or None
    # Per request whose prompt ended this step and that asked for prompt_logprobs: per prompt token after the first,
    # (its id then the top ids, their logprobs, its rank), or None where its logprob was not computed here.
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int] | None]] = field(default_factory=dict)
    # A pooling runner: per request whose prompt ended this step, its pooled result (a float32 CPU tensor)
    pooler_output: dict[str, Any] = field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, gc=False):
    """Per request, per step: new tokens and, when it ended, why (a msgspec struct: one is built per running
    request and step, about 4x faster than a slotted dataclass; no reference cycle goes through it)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    num_cached_tokens: int = 0
    extra: dict[str, Any] | None = None  # {"error": message} of a request the engine could not serve
    kv_transfer_params: dict | None = None  # a KV connector's, with the request's last output
    prompt_logprobs: list[tuple[list[int], list[float], int] | None] | None = None  # as ModelRunnerOutput's
    pooling_output: Any = None  # a pooling request's result (ModelRunnerOutput.pooler_output), when it ended

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
