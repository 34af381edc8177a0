"""Beam search over `AsyncLLM` (what the server's `use_beam_search` runs): each step submits every live beam's
one-token request at once and waits for all of them (vlserve.beam_search holds the beams and ranks them). Cancelling
the caller (a client that hung up) or any failure aborts every beam request still in flight, so no KV block or
encoder cache reference outlives the search.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from typing import Any

from vlserve.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence
from vlserve.engine.async_llm import AsyncLLM
from vlserve.engine.input_processor import ProcessedPrompt
from vlserve.outputs import RequestOutput


@dataclass
class AsyncBeamSearchResult:
    """The best beams of one prompt, best first, and what usage reports need."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0  # prompt tokens of the first step served from the prefix cache


async def gather_or_cancel(*aws: Awaitable[Any]) -> list[Any]:
    """`asyncio.gather`, but the first failure (or a cancellation of the caller) cancels the others and waits for
    them to unwind, so none keeps a request running behind the caller's back."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _one_token(
    engine: AsyncLLM, request_id: str, prompt: ProcessedPrompt, tokens: list[int], params
) -> RequestOutput:
    """One beam's step: a request of one token on the beam's tokens (the prompt's media kept); its final output."""
    stream = await engine.add_request(request_id, ProcessedPrompt(None, tokens, prompt.mm_features), params)
    last = None
    async with stream:  # leaving early (cancelled) aborts the request
        async for out in stream:
            last = out
    if last is not None and last.outputs and last.outputs[0].finish_reason == "abort":
        raise RuntimeError(f"beam request {request_id} was aborted by the engine")
    if last is None or not last.outputs or not last.outputs[0].logprobs:
        raise RuntimeError(f"beam request {request_id} ended without a token")
    return last


async def beam_search(
    engine: AsyncLLM, prompt: ProcessedPrompt, params: BeamSearchParams, request_id: str
) -> AsyncBeamSearchResult:
    """Run vLLM's beam search for one processed prompt on `engine`; the `params.beam_width` best beams."""
    eos = tuple(engine.engine.loaded.eos_token_ids)
    search = BeamSearch(list(prompt.prompt_token_ids), params, eos)
    step = replace(search.step_params(), detokenize=False)  # only the candidates' logprobs are read
    cached = 0
    while not search.done:
        outs = await gather_or_cancel(
            *(
                _one_token(engine, f"{request_id}-s{search.num_steps}-b{i}", prompt, beam.tokens, step)
                for i, beam in enumerate(search.live)
            )
        )
        if search.num_steps == 0:
            cached = outs[0].num_cached_tokens
        search.advance([{t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()} for out in outs])
    return AsyncBeamSearchResult(search.best(), list(prompt.prompt_token_ids), cached)
