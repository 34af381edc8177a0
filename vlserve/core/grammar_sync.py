"""Keeping each constrained request's grammar matcher in step with its tokens (pure Python, no torch).

A request with structured outputs carries a matcher (`Request.structured_output`, a StructuredOutputRequest): it
waits in the queue until its grammar has compiled, every token it keeps is fed to the matcher, drafts are cut to
the prefix the grammar allows before they are verified, and a matcher that reached its end finishes the request.
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
    its bonus row follow in order), the matchers and drafts in row order for filling them."""

    first_row: dict[str, int] = field(default_factory=dict)
    matchers: list = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    num_rows: int = 0


def grammar_waiting(req: Request) -> bool:
    """True while the request's grammar is still compiling (it stays in the queue; others go ahead)."""
    so = req.structured_output
    return so is not None and not so.is_ready()


def grammar_error(req: Request) -> str | None:
    """The compile error of the request's grammar, if it failed."""
    so = req.structured_output
    return None if so is None else so.error


def advance_matcher(req: Request, new_tokens: list[int]) -> None:
    """Feed the tokens the request kept to its matcher; a grammar that reached its end stops the request."""
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
        if req.structured_output is None or req.num_computed_tokens < req.num_tokens:
            continue
        drafts = spec_tokens.get(rid, [])
        rows.first_row[rid] = rows.num_rows
        rows.matchers.append(req.structured_output)
        rows.drafts.append(drafts)
        rows.num_rows += len(drafts) + 1
    return rows
