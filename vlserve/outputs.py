"""vLLM-shaped results returned by `LLM.generate` and streamed by `AsyncLLM`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    """A token's log probability, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the n sequences generated for a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request: cumulative text and tokens of each of its n outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # per prompt token (prompt_logprobs asked for): None for the first, then {token id: Logprob} of the token itself
    # and the top ones; None when not asked for
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    encoder_stats: dict = field(default_factory=dict)
    kv_transfer_params: dict | None = None  # a KV connector's (a producer's: where the decode side finds the KV)


@dataclass
class PoolingOutput:
    """A pooling request's result: float32 on the CPU; [D] for embed, [num_labels] for classify / score, [T, H]
    for ALL pooling (encode)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """The final output of a pooling request."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result per prompt (vLLM's shape)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.tolist()), out.prompt_token_ids, out.finished)


@dataclass
class ClassificationRequestOutput:
    """`LLM.classify`'s result per prompt (vLLM's shape)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, ClassificationOutput(out.outputs.data.tolist()), out.prompt_token_ids, out.finished)


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result per pair (vLLM's shape): a cross-encoder's probability, or two embeddings' cosine."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
