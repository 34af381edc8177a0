"""The xgrammar backend: constraints compile to xgrammar `CompiledGrammar`s, requests walk `GrammarMatcher`s.

How each kind compiles:
- json: `compile_json_schema` (strict mode: properties the schema does not name are not generated);
- json_object: the schema {"type": "object"} with strict mode off, i.e. any JSON object. xgrammar's builtin JSON
  grammar would also allow a top-level array and ignores disable_any_whitespace, so it is not used;
- regex: `compile_regex`;
- choice: an EBNF `root ::= "a" | "b"` with every choice written as an escaped string literal;
- grammar: xgrammar's EBNF (GBNF) when a line defines a rule with `name ::=`, else Lark (`compile_lark`, which needs a
  `start` rule);
- structural_tag: `compile_structural_tag` on xgrammar's structural-tag JSON.

Matchers are built without max_rollback_tokens: since xgrammar 0.2 rollback is unlimited and the argument is
deprecated (it only warns), so speculative decoding can roll back any number of draft tokens.
"""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from vlserve.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from vlserve.structured_output.params import StructuredOutputsConfig

# xgrammar's C++ errors start with "[19:35:29] /project/cpp/regex_converter.cc:83: " and sometimes
# "Check failed: (cond) is false: "; the user needs neither.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")
_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w.-]*\s*::=", re.MULTILINE)
_SIMPLE_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def compiler_message(error: BaseException) -> str:
    """xgrammar's error text without its C++ timestamp, file:line and check-condition prefixes."""
    text = str(error).strip()
    text = _CPP_PREFIX.sub("", text)
    return _CHECK_FAILED.sub("", text).strip() or type(error).__name__


def ebnf_string_literal(text: str) -> str:
    """text as an xgrammar EBNF string literal: quoted, with backslash, quote and control characters escaped."""
    out = []
    for ch in text:
        if ch in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[ch])
        elif ch.isprintable() or ord(ch) > 0xFFFF:
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}")
    return '"' + "".join(out) + '"'


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(ebnf_string_literal(c) for c in choices)


def is_ebnf(grammar: str) -> bool:
    """True for xgrammar / GBNF EBNF (rules defined with `::=`), False for Lark (`rule: ...`)."""
    return _EBNF_RULE.search(grammar) is not None


class XgrammarGrammar(StructuredOutputGrammar):
    """One request's xgrammar GrammarMatcher."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_tokens(self, tokens: list[int]) -> bool:
        for token in tokens:
            if not self.matcher.accept_token(token):
                return False
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted = 0
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return tokens[:accepted]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # bitmask: [R, words] int32 on the CPU; xgrammar refuses to fill after the stop token
        if self.matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    """Compiles constraints with xgrammar for one HF tokenizer; vocab_size is the model's logits width (it may
    exceed len(tokenizer): the extra ids are never allowed); stop_token_ids: the checkpoint's EOS ids (None: the
    tokenizer's eos_token_id)."""

    name = "xgrammar"

    def __init__(
        self, tokenizer, vocab_size: int, config: StructuredOutputsConfig, stop_token_ids: list[int] | None = None
    ) -> None:
        super().__init__(vocab_size, config)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) if stop_token_ids else None
        )
        # The manager caches compiled grammars itself; xgrammar's own cache would only hide compiles from it.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)

    def compile_constraint(self, kind: str, spec: str, any_whitespace: bool) -> xgr.CompiledGrammar:
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
            if kind == "json_object":
                return self.compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False
                )
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_ebnf(json.loads(spec)))
            if kind == "grammar":
                return self.compiler.compile_grammar(spec) if is_ebnf(spec) else self.compiler.compile_lark(spec)
            if kind == "structural_tag":
                return self.compiler.compile_structural_tag(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured outputs {kind}: {compiler_message(e)}") from None
        raise ValueError(f"structured outputs: the xgrammar backend does not know the kind {kind!r}")

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(compiled)
