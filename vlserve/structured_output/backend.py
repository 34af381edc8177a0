"""The grammar-backend interface: a backend compiles a constraint once, and each request walks its own matcher.

Token bitmasks follow xgrammar's layout: int32 [num_rows, ceil(vocab_size / 32)], token t is allowed in a row when
bit (t % 32) of word (t // 32) is set; a row of -1 (all bits set) constrains nothing.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

import torch

from vlserve.structured_output.params import StructuredOutputsConfig, StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    """How many int32 words one bitmask row needs for vocab_size tokens."""
    return (vocab_size + 31) // 32


def constraint_text(params: StructuredOutputsParams) -> str:
    """The constraint as the compilers read it: params.spec(), except that JSON keeps the request's key order
    (spec() sorts keys, but a schema's property order is the order the generated object follows)."""
    if params.kind in ("json", "structural_tag"):
        value = getattr(params, params.kind)
        return json.dumps(json.loads(value) if isinstance(value, str) else value, ensure_ascii=False)
    return params.spec()


class StructuredOutputGrammar(ABC):
    """One request's matcher state: what has been accepted so far and what may come next."""

    @abstractmethod
    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance over tokens in order; at the first token the grammar does not allow, stop and return False (the
        tokens before it stay accepted, that token leaves the state unchanged)."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of tokens the matcher would accept; the state is unchanged afterwards."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32 [R, words] on the CPU); a terminated matcher
        writes -1 (nothing left to constrain)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the stop token has been accepted."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start state, as if no token had been accepted."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary width (xgrammar or llguidance).

    Compiling is split in two so that a cache can sit between the halves: `compile_constraint` does the expensive,
    shareable work and `new_grammar` makes a fresh matcher from its result for each request."""

    name: str = ""

    def __init__(self, vocab_size: int, config: StructuredOutputsConfig) -> None:
        self.vocab_size = vocab_size
        self.config = config

    def any_whitespace(self, params: StructuredOutputsParams) -> bool:
        """Whether JSON may hold free whitespace: the request's setting, else the engine's."""
        disable = params.disable_any_whitespace
        if disable is None:
            disable = self.config.disable_any_whitespace
        return not disable

    @abstractmethod
    def compile_constraint(self, kind: str, spec: str, any_whitespace: bool) -> Any:
        """Compile one constraint (its kind and constraint_text); the result is immutable
        and shared by every request with the same constraint. A constraint the compiler rejects is a ValueError
        carrying the compiler's message."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher, at the start state, over a compile_constraint result."""

    def compile(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """Compile params (no cache) and return a fresh matcher for it."""
        return self.new_grammar(
            self.compile_constraint(params.kind, constraint_text(params), self.any_whitespace(params))
        )

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A CPU int32 [num_rows, bitmask_words(vocab_size)] bitmask with every token allowed."""
        return torch.full((num_rows, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
