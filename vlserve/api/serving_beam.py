"""`"use_beam_search": true` on /v1/completions and /v1/chat/completions (vLLM's extra field): `n` beams, best first.

As vLLM: beam_width = n, with max_tokens (max_completion_tokens), ignore_eos, length_penalty,
include_stop_str_in_output (an EOS that ended a beam counts in its completion tokens; it is never in the text);
each choice's text is the generated part, finish_reason "stop" for a beam that ended in EOS, else "length"; usage
counts each prompt once and the tokens of every returned beam. Beyond vLLM: `early_stopping` (stop once n beams have
ended). Fields that would change the output under beam search and that it does not implement (stop strings,
logprobs, sampling knobs, penalties, seed, structured outputs, tools, echo, ...) are 400s naming the field, as is
`stream` (the search returns only once all beams are ranked) and a temperature above 0.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vlserve.api.errors import APIError
from vlserve.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from vlserve.api.reasoning_output import ReasoningOutput
from vlserve.api.request_fields import BEAM_SEARCH_FIELDS, check_extra_fields
from vlserve.api.serving_base import run_unless_disconnected
from vlserve.beam_search import MAX_BEAM_WIDTH, BeamSearchParams, BeamSearchSequence
from vlserve.engine.async_llm import AsyncLLM
from vlserve.engine.beam_search_async import AsyncBeamSearchResult, beam_search, gather_or_cancel
from vlserve.engine.input_processor import ProcessedPrompt
from vlserve.reasoning import ReasoningParser
from vlserve.shorten import shorten

_NO_TEXT = (None, "", [])
# Declared request fields beam search does not implement, with the values that change nothing.
_REFUSED_COMMON: dict[str, tuple] = {
    "stop": _NO_TEXT,
    "stop_token_ids": (None, []),
    "seed": (None,),
    "top_p": (None, 1, 1.0),
    "top_k": (None, -1, 0),
    "min_p": (None, 0, 0.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_tokens": (0,),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
}
_REFUSED = {
    "completion": {**_REFUSED_COMMON, "logprobs": (None,), "echo": (False,), "suffix": (None, "")},
    "chat": {
        **_REFUSED_COMMON,
        "logprobs": (False,),
        "top_logprobs": (None,),
        "tools": (None, []),
        "tool_choice": (None, "none", "auto"),
    },
}


def wants_beam_search(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether the request asks for beam search (`use_beam_search`, a boolean: 400 otherwise)."""
    value = (req.model_extra or {}).get("use_beam_search")
    if value is not None and not isinstance(value, bool):
        raise APIError(f"use_beam_search must be a boolean, got {shorten(value)}", 400, "use_beam_search")
    return bool(value)


@dataclass
class BeamRequest:
    """The beam-search settings of one validated request (everything but the length, which needs the prompt)."""

    n: int
    max_tokens: int | None  # None: what the context leaves after the prompt
    max_tokens_field: str
    ignore_eos: bool
    length_penalty: float
    early_stopping: bool
    include_stop_str_in_output: bool
    skip_special_tokens: bool

    @classmethod
    def from_request(cls, req: CompletionRequest | ChatCompletionRequest, endpoint: str) -> BeamRequest:
        """Validate a use_beam_search request (APIError 400 naming the field at fault)."""
        extra = req.model_extra or {}
        check_extra_fields({k: v for k, v in extra.items() if k not in BEAM_SEARCH_FIELDS}, endpoint)
        if req.stream:
            raise APIError(
                "beam search does not stream: it returns only once the beams are ranked; send "
                "stream=false with use_beam_search",
                400,
                "stream",
            )
        for name, noops in _REFUSED[endpoint].items():
            if getattr(req, name) not in noops:
                raise APIError(
                    f"{name} is not supported with use_beam_search (it would change the output); leave it out",
                    400,
                    name,
                )
        if req.temperature not in (None, 0, 0.0):
            raise APIError(
                f"beam search ranks beams by their logprobs and samples nothing: temperature must be 0 "
                f"or left out, got {req.temperature}",
                400,
                "temperature",
            )
        if not 1 <= req.n <= MAX_BEAM_WIDTH:
            raise APIError(
                f"n (the beam width with use_beam_search) must be in [1, {MAX_BEAM_WIDTH}], got {req.n}", 400, "n"
            )
        length_penalty = extra.get("length_penalty", 1.0)
        if length_penalty is None:
            length_penalty = 1.0
        if (
            isinstance(length_penalty, bool)
            or not isinstance(length_penalty, (int, float))
            or not math.isfinite(length_penalty)
        ):
            raise APIError(f"length_penalty must be a number, got {shorten(length_penalty)}", 400, "length_penalty")
        early_stopping = extra.get("early_stopping", False)
        if early_stopping is not None and not isinstance(early_stopping, bool):
            raise APIError(f"early_stopping must be a boolean, got {shorten(early_stopping)}", 400, "early_stopping")
        field = "max_tokens"
        max_tokens = req.max_tokens
        if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            field, max_tokens = "max_completion_tokens", req.max_completion_tokens
        if max_tokens is not None and max_tokens < 1:
            raise APIError(f"{field} must be an integer >= 1, got {max_tokens}", 400, field)
        return cls(
            req.n,
            max_tokens,
            field,
            req.ignore_eos,
            float(length_penalty),
            bool(early_stopping),
            req.include_stop_str_in_output,
            req.skip_special_tokens,
        )

    def params(self, prompt_tokens: int, max_model_len: int) -> BeamSearchParams:
        """BeamSearchParams for a prompt of `prompt_tokens` (400 when prompt + max_tokens exceed the context)."""
        room = max_model_len - prompt_tokens
        if room < 1:
            raise APIError(
                f"the prompt ({prompt_tokens} tokens) leaves no room for a completion in this model's "
                f"context (max_model_len {max_model_len}); shorten it",
                400,
            )
        max_tokens = room if self.max_tokens is None else self.max_tokens
        if max_tokens > room:
            raise APIError(
                f"{self.max_tokens_field} is too large: this model's context (max_model_len) holds "
                f"{max_model_len} tokens, the prompt uses {prompt_tokens}, and {max_tokens} were "
                f"requested for the completion; ask for at most {room}",
                400,
                self.max_tokens_field,
            )
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


@dataclass
class BeamChoice:
    """One returned beam as a response choice: its text, completion token count and finish reason."""

    text: str
    num_tokens: int
    finish_reason: str


def beam_choice(engine: AsyncLLM, beam: BeamSearchSequence, spec: BeamRequest) -> BeamChoice:
    """The generated part of `beam` decoded in one piece, as vLLM's beam search and `LLM.beam_search` decode it
    (skip_special_tokens as asked; an ending EOS never in the text)."""
    tokens = beam.output_tokens
    ended = beam.finished
    text_tokens = tokens[:-1] if ended else tokens
    text = engine.tokenizer.decode(text_tokens, skip_special_tokens=spec.skip_special_tokens)
    counted = len(tokens) if (spec.include_stop_str_in_output or not ended) else len(tokens) - 1
    return BeamChoice(text, counted, "stop" if ended else "length")


def _usage(results: list[AsyncBeamSearchResult], choices: list[BeamChoice]) -> UsageInfo:
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(c.num_tokens for c in choices)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.num_cached_tokens for r in results)),
    )


async def run_beam_searches(
    engine: AsyncLLM, processed: list[ProcessedPrompt], spec: BeamRequest, request_id: str, raw: Request
) -> tuple[list[AsyncBeamSearchResult], list[list[BeamChoice]]]:
    """One beam search per prompt, all at once; a client that hangs up cancels them (every beam request aborted)."""
    params = [spec.params(len(p.prompt_token_ids), engine.max_model_len) for p in processed]
    work = gather_or_cancel(
        *(beam_search(engine, p, bp, f"{request_id}-{i}") for i, (p, bp) in enumerate(zip(processed, params)))
    )
    results = await run_unless_disconnected(raw, work, lambda: None)  # the cancellation aborts the beams
    choices = [[beam_choice(engine, b, spec) for b in r.sequences] for r in results]
    return results, choices


async def beam_completion(
    engine: AsyncLLM,
    req: CompletionRequest,
    raw: Request,
    model: str,
    process: Callable[[str | list[int]], Awaitable[ProcessedPrompt]],
) -> Response:
    """POST /v1/completions with use_beam_search; `process(prompt)` is the endpoint's input processing."""
    spec = BeamRequest.from_request(req, "completion")
    processed = [await process(p) for p in req.prompts()]
    request_id = random_id("cmpl")
    results, choices = await run_beam_searches(engine, processed, spec, request_id, raw)
    body = CompletionResponse(
        id=request_id,
        model=model,
        usage=_usage(results, sum(choices, [])),
        choices=[
            CompletionChoice(index=p * spec.n + i, text=c.text, finish_reason=c.finish_reason)
            for p, beams in enumerate(choices)
            for i, c in enumerate(beams)
        ],
    )
    return JSONResponse(body.model_dump())


async def beam_chat(
    engine: AsyncLLM,
    req: ChatCompletionRequest,
    raw: Request,
    model: str,
    process: Callable[[ChatCompletionRequest], Awaitable[ProcessedPrompt]],
    reasoning_parser: ReasoningParser | None = None,
) -> Response:
    """POST /v1/chat/completions with use_beam_search; `process(req)` is the endpoint's chat input processing
    (template, media) -> one ProcessedPrompt; `reasoning_parser` (the server's) splits each beam's reasoning off."""
    spec = BeamRequest.from_request(req, "chat")
    processed = await process(req)
    split = ReasoningOutput(reasoning_parser, processed.prompt_token_ids, req.include_reasoning)
    request_id = random_id("chatcmpl")
    results, choices = await run_beam_searches(engine, [processed], spec, request_id, raw)
    body = ChatCompletionResponse(
        id=request_id,
        model=model,
        usage=_usage(results, choices[0]),
        choices=[
            ChatChoice(index=i, message=split.message(c.text), finish_reason=c.finish_reason)
            for i, c in enumerate(choices[0])
        ],
    )
    return JSONResponse(body.model_dump())
