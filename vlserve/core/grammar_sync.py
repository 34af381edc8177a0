"""Keeping each constrained request's grammar matcher in step with its tokens (pure Python, no torch).

A request with structured outputs carries a matcher (`Request.structured_output`, a StructuredOutputRequest): it
waits in the queue until its grammar has compiled, every token it keeps is fed to the matcher, drafts are cut to
the prefix the grammar allows before they are verified, and a matcher that reached its end finishes the request.
With a reasoning parser a request also carries a `ReasoningTracker` (`Request.reasoning`): its grammar starts
after the end-of-reasoning token, and a spent thinking budget forces that token.
The rows of the step's token bitmask are laid out here; the engine fills them, the runner applies them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vlserve.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class BitmaskRows:
    """The bitmask rows of one step: per constrained request that samples, its first row (its drafts' rows then
    its bonus row follow in order), the matchers (None: a free row) and drafts in row order for filling them;
    then rows that allow only one token (`force_only`: a spent thinking budget's end token) and rows that also
    allow one (`also_allow`: the start token where the output may still open its reasoning)."""

    first_row: dict[str, int] = field(default_factory=dict)
    matchers: list = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    num_rows: int = 0
    force_only: dict[int, int] = field(default_factory=dict)
    also_allow: dict[int, int] = field(default_factory=dict)


def grammar_waiting(req: Request) -> bool:
    """True while the request's grammar is still compiling (it stays in the queue; others go ahead)."""
    so = req.structured_output
    return so is not None and not so.is_ready()


def grammar_error(req: Request) -> str | None:
    """The compile error of the request's grammar, if it failed."""
    so = req.structured_output
    return None if so is None else so.error


def advance_matcher(req: Request, new_tokens: list[int]) -> None:
    """Feed the tokens the request kept to its reasoning tracker, then those after the reasoning to its matcher;
    a grammar that reached its end stops the request."""
    if req.reasoning is not None and not req.reasoning.ended:
        new_tokens = req.reasoning.advance(new_tokens)
    so = req.structured_output
    if so is None or not new_tokens:
        return
    if not so.accept_tokens(new_tokens):
        # The bitmask allowed only grammar tokens, so this means a bug or a token past the grammar's end.
        logger.warning("request %s: the grammar refused token(s) %s", req.request_id, new_tokens)
    if so.is_terminated() and not req.is_finished():
        req.status = RequestStatus.FINISHED_STOPPED


def allowed_drafts(req: Request, drafts: list[int]) -> list[int]:
    """The longest prefix of the proposed drafts the request's grammar accepts (all of them when unconstrained)."""
    if req.reasoning is not None and not req.reasoning.ended:
        return req.reasoning.allowed_drafts(drafts)
    so = req.structured_output
    if so is None or not drafts:
        return drafts
    if so.is_terminated():
        return []
    return so.validate_tokens(drafts)


def bitmask_rows(
    requests: dict[str, Request], num_scheduled: dict[str, int], spec_tokens: dict[str, list[int]]
) -> BitmaskRows:
    """Lay out the bitmask rows of a planned step: constrained requests whose window reaches their last token
    (a partial prefill samples nothing), each with one row per verified draft plus its bonus row."""
    rows = BitmaskRows()
    for rid in num_scheduled:
        req = requests[rid]
        matcher, tracker = req.structured_output, req.reasoning
        if (matcher is None and tracker is None) or req.num_computed_tokens < req.num_tokens:
            continue
        drafts = spec_tokens.get(rid, [])
        if tracker is not None and not tracker.ended:  # the grammar has not started: free rows, but for ...
            bonus_row, forced = rows.num_rows + len(drafts), tracker.forced_token(len(drafts))
            if forced is not None:  # ... a spent budget's end token
                rows.force_only[bonus_row], matcher = forced, None
            elif tracker.pending and matcher is not None:  # ... the grammar's first token or the start token
                rows.also_allow[bonus_row] = tracker.tokens.start_token_id
            else:
                continue
        elif matcher is None:
            continue
        rows.first_row[rid] = rows.num_rows
        rows.matchers.append(matcher)
        rows.drafts.append(drafts)
        rows.num_rows += len(drafts) + 1
    return rows


def _bit(token: int) -> int:
    """Token's bit in its int32 bitmask word, as a signed 32-bit value."""
    bit = 1 << (token % 32)
    return bit - (1 << 32) if bit >= 1 << 31 else bit


def apply_reasoning_rows(bitmask, force_only: dict[int, int], also_allow: dict[int, int]):
    """Edit a filled int32 bitmask [rows, words] in place for the reasoning rows of `BitmaskRows`: a row of
    `force_only` allows its one token, a row of `also_allow` its token besides the grammar's; returns it."""
    for row, token in force_only.items():
        bitmask[row, :] = 0
        bitmask[row, token // 32] = _bit(token)
    for row, token in also_allow.items():
        bitmask[row, token // 32] |= _bit(token)
    return bitmask
