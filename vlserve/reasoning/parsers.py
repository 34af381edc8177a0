"""Reasoning parsers: split a thinking model's text into reasoning and content, whole or streamed, and the
registry `--reasoning-parser NAME` picks from.

    parser = get_reasoning_parser("qwen3")(tokenizer)        # tokenizer: None for text-only use
    reasoning, content = parser.extract(text, prompt_token_ids)
    stream = parser.new_stream(prompt_token_ids)
    reasoning_delta, content_delta = stream.feed(text_delta, finished)
    parser.num_reasoning_tokens(output_token_ids, prompt_token_ids)   # usage's reasoning_tokens

Both follow one rule (the engine's `ReasoningTracker` follows it in token ids): the prompt's last tag says where
the output begins (`initial_state`: an open `<think>`: inside reasoning; a closed one: content); with neither, it
begins inside reasoning when the parser reasons by default, else it is pending: a leading start tag opens
reasoning, anything else is content. Reasoning runs to the end tag; output that never reaches it is all
reasoning. Pass the prompt's token ids: without them the output begins as with a prompt without tags.
"""

from __future__ import annotations

from typing import ClassVar

from vlserve.reasoning.tracker import ReasoningState, ReasoningTokens, ReasoningTracker, initial_state
from vlserve.shorten import shorten

_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(cls: type[ReasoningParser]) -> type[ReasoningParser]:
    """Class decorator: make `cls` available under `cls.name`."""
    _PARSERS[cls.name] = cls
    return cls


def reasoning_parser_names() -> list[str]:
    """The registered parser names, sorted."""
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name` (ValueError listing the names otherwise)."""
    cls = _PARSERS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown reasoning parser {shorten(name)}; choose one of {', '.join(reasoning_parser_names())}"
        )
    return cls


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (held back until it is told)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningStream:
    """One output's split, fed its text in deltas; `feed` returns (reasoning delta, content delta), each None
    when empty. A possible partial tag at a delta's end is held back until the next delta or `finished`."""

    def __init__(self, start_tag: str, end_tag: str, state: ReasoningState) -> None:
        self.start_tag = start_tag
        self.end_tag = end_tag
        self.state = state
        self.reasoned = state is ReasoningState.REASONING  # whether any reasoning began (else extract says None)
        self._at_reasoning_start = self.reasoned  # a start tag right here is dropped (R1 may or may not send it)
        self._held = ""

    def feed(self, delta: str, finished: bool = False) -> tuple[str | None, str | None]:
        text, self._held = self._held + delta, ""
        reasoning = content = ""
        if self.state is ReasoningState.PENDING:
            if text.startswith(self.start_tag):
                text = text[len(self.start_tag) :]
                self.state, self.reasoned = ReasoningState.REASONING, True
            elif self.start_tag.startswith(text) and not finished:
                self._held = text
                return None, None
            else:
                self.state = ReasoningState.ENDED
        if self.state is ReasoningState.REASONING and self._at_reasoning_start and text:
            if text.startswith(self.start_tag):
                text = text[len(self.start_tag) :]
            elif self.start_tag.startswith(text) and not finished:
                self._held = text
                return None, None
            self._at_reasoning_start = False
        if self.state is ReasoningState.REASONING:
            end = text.find(self.end_tag)
            if end >= 0:
                reasoning, text = text[:end], text[end + len(self.end_tag) :]
                self.state = ReasoningState.ENDED
            else:
                keep = 0 if finished else _partial_tag_len(text, self.end_tag)
                reasoning, self._held, text = text[: len(text) - keep], text[len(text) - keep :], ""
        if self.state is ReasoningState.ENDED:
            content = text
        return reasoning or None, content or None


class ReasoningParser:
    """Splits a thinking model's output into reasoning and content (see the module docstring for the rule).

    `tokenizer` (optional for text-only use) supplies the tags' token ids (`token_ids()`, `is_reasoning_end`); each
    tag must be one token of its vocabulary (ValueError otherwise)."""

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    reasoning_by_default: ClassVar[bool] = False

    def __init__(self, tokenizer=None) -> None:
        self.tokens: ReasoningTokens | None = None
        if tokenizer is not None:
            self.tokens = ReasoningTokens(
                _single_token_id(tokenizer, self.start_tag, self.name),
                _single_token_id(tokenizer, self.end_tag, self.name),
                self.reasoning_by_default,
            )

    def token_ids(self) -> ReasoningTokens:
        """The tags' token ids (ValueError when built without a tokenizer)."""
        if self.tokens is None:
            raise ValueError(f"the {self.name} reasoning parser was built without a tokenizer")
        return self.tokens

    def initial_state(self, prompt_token_ids: list[int] | None = None) -> ReasoningState:
        """Where the output after this prompt begins (see `tracker.initial_state`)."""
        return initial_state(prompt_token_ids, self.tokens, self.reasoning_by_default)

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """Whether reasoning is over after these ids (prompt + output so far): the last tag among them ends it."""
        tokens = self.token_ids()
        for token in reversed(token_ids):
            if token == tokens.end_token_id:
                return True
            if token == tokens.start_token_id:
                return False
        return False

    def num_reasoning_tokens(self, output_token_ids: list[int], prompt_token_ids: list[int] | None = None) -> int:
        """How many output tokens lie inside the reasoning (the tags not counted), as the engine counts them for a
        thinking budget (usage's reasoning_tokens)."""
        tracker = ReasoningTracker(self.token_ids(), list(prompt_token_ids or ()))
        tracker.advance(list(output_token_ids))
        return tracker.num_reasoning_tokens

    def new_stream(self, prompt_token_ids: list[int] | None = None) -> ReasoningStream:
        """A streaming split of one output generated after this prompt."""
        return ReasoningStream(self.start_tag, self.end_tag, self.initial_state(prompt_token_ids))

    def extract(self, text: str, prompt_token_ids: list[int] | None = None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; reasoning None when the output did not reason, content None
        when empty. Equal to the joined deltas of `new_stream` over any split of `text`."""
        stream = self.new_stream(prompt_token_ids)
        reasoning, content = stream.feed(text, finished=True)
        return (reasoning or "") if stream.reasoned else None, content


def _single_token_id(tokenizer, tag: str, parser: str) -> int:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the {parser} reasoning parser needs {tag} to be one token of the tokenizer; it is {ids}")
    return int(ids[0])


@register_reasoning_parser
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: `<think>...</think>` that the model opens itself, or that the prompt opens (thinking templates
    ending in `<think>`); `enable_thinking: false` closes an empty one in the prompt, so the output is content."""

    name = "qwen3"


@register_reasoning_parser
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: everything up to `</think>` is reasoning, with or without a leading `<think>`."""

    name = "deepseek_r1"
    reasoning_by_default = True
