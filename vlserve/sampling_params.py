"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM-compatible names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vlserve.structured_output.params import StructuredOutputsParams

_MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64  # each one is searched for in every step's new text
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request decoding options; validated on construction (ValueError says what to change)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top ones (RequestOutput.prompt_logprobs)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar to follow
    # KV transfer (disaggregated serving, vLLM's kv_transfer_params): {"do_remote_decode": True} on a prefill
    # request asks its engine to keep the KV for a consumer; a decode request carries what the prefill's output
    # returned ({"do_remote_prefill": True, "remote_host", "remote_port", "remote_block_ids", ...}).
    kv_transfer_params: dict | None = None
    # Logits adjustments, applied before sampling (returned logprobs stay the model's own): a bias added to a token's
    # logit (in [-100, 100]), the only ids that may be sampled, and words never generated (vLLM's bad_words: the
    # engine tokenizes each, with and without a leading space, into `_bad_words_token_ids`).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # keep only the prompt's last k tokens (-1: max_model_len tokens; None: the whole prompt), as vLLM does
    truncate_prompt_tokens: int | None = None
    # With a reasoning parser (EngineArgs.reasoning_parser): the most tokens inside the reasoning before the engine
    # forces its end token; None: no limit. An engine without a reasoning parser refuses it.
    thinking_token_budget: int | None = None
    # Filled by the engine: ids that end the request (EOS plus generation_config's eos list).
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict of its fields)")
        self._verify_logits_adjustments()
        self._verify()

    def _verify_logits_adjustments(self) -> None:
        """Normalize and check logit_bias (keys may be id strings, as OpenAI sends them), allowed_token_ids and
        bad_words; the vocabulary bounds are checked by the engine, which knows the vocabulary."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to biases.")
            bias = {}
            for token, value in self.logit_bias.items():
                tid = int(token) if isinstance(token, str) and token.strip().lstrip("-").isdigit() else token
                if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
                    raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {token!r}.")
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not -100 <= value <= 100:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r}.")
                bias[tid] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids.")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                raise ValueError("allowed_token_ids must hold non-negative integers.")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words
            ):
                raise ValueError("bad_words must be a list of non-empty strings.")
            self.bad_words = list(self.bad_words) or None

    def _verify(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}.")
        if self.temperature < 0.0:
            bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            bad(f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}.")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS:
            bad(f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}], got {self.prompt_logprobs}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers.")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k == 0 or k < -1):
            bad(f"truncate_prompt_tokens must be an integer >= 1 or -1 (max_model_len), got {k!r}.")
        budget = self.thinking_token_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            bad(f"thinking_token_budget must be an integer >= 0, got {budget!r}.")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -(2**63) <= self.seed < 2**63 - 1024
        ):
            bad(f"seed must be an integer that fits in int64, got {self.seed!r}.")

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """True when logit_bias, allowed_token_ids or bad_words change the logits before sampling."""
        return bool(self.logit_bias or self.allowed_token_ids or self._bad_words_token_ids)

    @property
    def reads_output_tokens(self) -> bool:
        """True when sampling reads the output tokens so far (penalties count them; bad words match their tail)."""
        return self.needs_penalties or bool(self._bad_words_token_ids)

    def all_stop_token_ids(self) -> set[int]:
        """Token ids that end generation (EOS unless ignore_eos, plus stop_token_ids)."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(self._eos_token_ids)
        return ids
