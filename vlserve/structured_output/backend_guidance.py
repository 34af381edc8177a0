"""The llguidance backend: constraints compile to a template `LLMatcher`; each request walks a deep copy of it.

llguidance does its real compiling (grammar parse, lexer build) when an LLMatcher is constructed, so the shareable
compile result is a matcher that never advances, and `new_grammar` copies it (cheap) instead of re-parsing the
grammar text for every request.

How each kind compiles: json and json_object (the schema {"type": "object"}) through llguidance's JSON-schema
compiler with `whitespace_flexible` = any_whitespace; regex as a regex; choice as a Lark alternation of JSON-quoted
strings; grammar as Lark, or GBNF / xgrammar-style EBNF converted to Lark by llguidance; structural_tag is not
supported (a ValueError that names the xgrammar backend).

An LLMatcher that is fed a token it does not allow enters an error state it never leaves, so tokens are validated
before they are consumed.
"""

from __future__ import annotations

import llguidance
import llguidance.hf
import torch

from vlserve.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from vlserve.structured_output.params import StructuredOutputsConfig


class GuidanceGrammar(StructuredOutputGrammar):
    """One request's llguidance LLMatcher, plus the bookkeeping of its stop token.

    llguidance treats a stop token after a grammar that cannot grow (it is already "stopped") as a no-op: its
    validate_tokens counts 0 for it, consume_tokens fails, consume_token succeeds without recording a step, so a
    later rollback would undo the token before it. Such a stop token is therefore recorded here only."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_accepted = 0
        self.eos_position: int | None = None  # where the accepted stop token is, if any
        self.eos_in_matcher = False  # whether llguidance recorded that stop token as a step

    def _num_valid(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar allows. llguidance's count is off for a stop token both ways (it
        refuses one after a grammar that cannot grow, and allows one where the grammar can go nowhere), so a stop
        token is judged here by whether the state before it is accepting."""
        if self.eos_position is not None:
            return 0
        valid = self.matcher.validate_tokens(tokens)
        eos_at = next((i for i, t in enumerate(tokens[: valid + 1]) if t in self.eos_token_ids), None)
        if eos_at is None:
            return valid
        self._consume(tokens[:eos_at])  # look at the state the tokens before it reach, then go back
        accepting = self.matcher.is_accepting()
        if eos_at:
            self.matcher.rollback(eos_at)
        return eos_at + 1 if accepting else eos_at

    def _consume(self, tokens: list[int]) -> None:
        for token in tokens:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused a token it had validated: {self.matcher.get_error()}")

    def accept_tokens(self, tokens: list[int]) -> bool:
        valid = self._num_valid(tokens)
        for token in tokens[:valid]:
            if token in self.eos_token_ids:
                self.eos_position = self.num_accepted
                self.eos_in_matcher = not self.matcher.is_stopped()
                if not self.eos_in_matcher:
                    self.num_accepted += 1
                    continue
            self._consume([token])
            self.num_accepted += 1
        return valid == len(tokens)

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens[: self._num_valid(tokens)]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} accepted")
        in_matcher = num_tokens
        if self.eos_position is not None and self.eos_position >= self.num_accepted - num_tokens:
            in_matcher -= not self.eos_in_matcher
            self.eos_position, self.eos_in_matcher = None, False
        if in_matcher and not self.matcher.rollback(in_matcher):
            raise RuntimeError(f"llguidance could not roll back {in_matcher} tokens: {self.matcher.get_error()}")
        self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # bitmask: [R, words] int32 on the CPU; llguidance writes words * 4 bytes at the row's address
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
            raise ValueError("the token bitmask must be a 2-D int32 CPU tensor")
        words = bitmask[row]
        if not words.is_contiguous():
            raise ValueError("the token bitmask's rows must be contiguous")
        if self.is_terminated():
            words.fill_(-1)
        else:
            self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def is_terminated(self) -> bool:
        return self.eos_position is not None

    def reset(self) -> None:
        self.matcher.reset()
        self.num_accepted = 0
        self.eos_position, self.eos_in_matcher = None, False


class GuidanceBackend(StructuredOutputBackend):
    """Compiles constraints with llguidance for one HF (fast) tokenizer; vocab_size is the model's logits width;
    stop_token_ids: the checkpoint's EOS ids (None: the tokenizer's eos_token_id)."""

    name = "guidance"

    def __init__(
        self, tokenizer, vocab_size: int, config: StructuredOutputsConfig, stop_token_ids: list[int] | None = None
    ) -> None:
        super().__init__(vocab_size, config)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids) if stop_token_ids else None
        )

    def grammar_text(self, kind: str, spec: str, any_whitespace: bool) -> str:
        """The llguidance grammar definition for one constraint (not yet checked)."""
        json_options = {"whitespace_flexible": any_whitespace}
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=json_options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=json_options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return llguidance.grammar_from("choice", spec)  # spec: the JSON list of strings
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
        if kind == "structural_tag":
            raise ValueError("structural_tag needs the xgrammar backend")
        raise ValueError(f"the guidance backend does not know the kind {kind!r}")

    def compile_constraint(self, kind: str, spec: str, any_whitespace: bool) -> llguidance.LLMatcher:
        try:
            text = self.grammar_text(kind, spec, any_whitespace)
        except ValueError as e:
            raise ValueError(f"structured outputs {kind}: {e}") from None
        template = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if template.is_error():
            raise ValueError(f"structured outputs {kind}: {template.get_error().strip()}")
        return template

    def new_grammar(self, compiled: llguidance.LLMatcher) -> GuidanceGrammar:
        return GuidanceGrammar(compiled.deep_copy(), self.ll_tokenizer.eos_tokens)
