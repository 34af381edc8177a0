"""Reasoning output: parsers that split a thinking model's text into reasoning and content (`parsers`), and the
engine's per-request view of where the reasoning ends in token ids (`tracker`)."""

from vlserve.reasoning.parsers import (
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)
from vlserve.reasoning.tracker import ReasoningState, ReasoningTokens, ReasoningTracker, initial_state

__all__ = [
    "ReasoningParser",
    "ReasoningState",
    "ReasoningStream",
    "ReasoningTokens",
    "ReasoningTracker",
    "get_reasoning_parser",
    "initial_state",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
