"""Where a request's reasoning ends, in token ids (pure Python): the engine uses it to start a grammar after the
end-of-reasoning token and to force that token once a thinking budget is spent.

A request's output begins inside reasoning, after it, or "pending" (`initial_state`): pending output that starts
with the start token enters reasoning, anything else means the model does not reason this turn. Reasoning ends at
the end token.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class ReasoningTokens:
    """A parser's tags as token ids. `reasoning_by_default`: a prompt with neither tag opens the output inside
    reasoning (DeepSeek-R1 may leave out its opening tag); otherwise such output is pending."""

    start_token_id: int
    end_token_id: int
    reasoning_by_default: bool


class ReasoningState(Enum):
    PENDING = "pending"  # nothing generated yet says whether the model reasons: a start token opens reasoning
    REASONING = "reasoning"
    ENDED = "ended"  # after the end token, or no reasoning this turn: content, where a grammar applies


def initial_state(
    prompt_token_ids: list[int] | None, tokens: ReasoningTokens | None, reasoning_by_default: bool
) -> ReasoningState:
    """Where the output after this prompt begins: the prompt's last tag decides (an open `<think>`: inside
    reasoning; a closed one, as `enable_thinking=False` leaves: after it); with neither tag (or no token ids),
    inside reasoning when the parser reasons by default, else pending."""
    if tokens is not None:
        for token in reversed(prompt_token_ids or ()):
            if token == tokens.start_token_id:
                return ReasoningState.REASONING
            if token == tokens.end_token_id:
                return ReasoningState.ENDED
    return ReasoningState.REASONING if reasoning_by_default else ReasoningState.PENDING


class ReasoningTracker:
    """One request's place in its reasoning, advanced by the tokens it keeps. `budget`: the most tokens allowed
    inside the reasoning (the tags not counted) before the end token is forced; None: no limit."""

    def __init__(self, tokens: ReasoningTokens, prompt_token_ids: list[int], budget: int | None = None) -> None:
        if budget is not None and budget < 0:
            raise ValueError(f"thinking_token_budget must be >= 0, got {budget}")
        self.tokens = tokens
        self.budget = budget
        self.num_reasoning_tokens = 0
        self.state = initial_state(prompt_token_ids, tokens, tokens.reasoning_by_default)

    @property
    def ended(self) -> bool:
        return self.state is ReasoningState.ENDED

    @property
    def pending(self) -> bool:
        return self.state is ReasoningState.PENDING

    def advance(self, new_tokens: list[int]) -> list[int]:
        """Take kept tokens; returns those that came after the reasoning ended (the grammar's to check)."""
        for i, token in enumerate(new_tokens):
            if self.state is ReasoningState.ENDED:
                return new_tokens[i:]
            if self.state is ReasoningState.PENDING:
                self.state = ReasoningState.REASONING if token == self.tokens.start_token_id else ReasoningState.ENDED
                if self.state is ReasoningState.ENDED:
                    return new_tokens[i:]
            elif token == self.tokens.end_token_id:
                self.state = ReasoningState.ENDED
            elif token != self.tokens.start_token_id:
                self.num_reasoning_tokens += 1
        return []

    def allowed_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts to verify while the reasoning has not ended: none while pending; inside reasoning, those
        before the first tag and within the budget (the tag and the forced end come as sampled tokens)."""
        if self.state is ReasoningState.PENDING:
            return []
        if self.state is ReasoningState.ENDED:
            return drafts
        keep = len(drafts)
        for i, token in enumerate(drafts):
            if token in (self.tokens.start_token_id, self.tokens.end_token_id):
                keep = i
                break
        if self.budget is not None:
            keep = min(keep, max(self.budget - self.num_reasoning_tokens, 0))
        return drafts[:keep]

    def forced_token(self, num_drafts: int) -> int | None:
        """The token the position after `num_drafts` drafts must take: the end token once the budget is spent
        there, else None."""
        if self.state is not ReasoningState.REASONING or self.budget is None:
            return None
        return self.tokens.end_token_id if self.num_reasoning_tokens + num_drafts >= self.budget else None
