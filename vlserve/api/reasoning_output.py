"""A chat request's reasoning: the server's reasoning parser (--reasoning-parser) splits each choice's text into
reasoning and content, whole or streamed; the reply carries it as `reasoning` and, under its older name,
`reasoning_content`, unless the request sent `include_reasoning: false`."""

from __future__ import annotations

from vlserve.api.protocol import ChatResponseMessage, DeltaMessage
from vlserve.reasoning import ReasoningParser, ReasoningStream, get_reasoning_parser


def reasoning_parser_of(engine) -> ReasoningParser | None:
    """The engine's reasoning parser (EngineArgs.reasoning_parser) over its tokenizer; None when it has none."""
    name = engine.engine_args.reasoning_parser
    return None if name is None else get_reasoning_parser(name)(engine.tokenizer)


class ReasoningOutput:
    """How one request's choices are split: `parser` (None: all text is content), the prompt's token ids (its
    last think tag says where the output begins) and whether the reply includes the reasoning."""

    def __init__(self, parser: ReasoningParser | None, prompt_token_ids: list[int], include: bool = True) -> None:
        self.parser = parser
        self.prompt_token_ids = prompt_token_ids
        self.include = include

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished choice; without a parser (None, text)."""
        if self.parser is None:
            return None, text
        return self.parser.extract(text, self.prompt_token_ids)

    def new_stream(self) -> ReasoningStream | None:
        """A streamed choice's split (None without a parser)."""
        return None if self.parser is None else self.parser.new_stream(self.prompt_token_ids)

    def message(self, text: str) -> ChatResponseMessage:
        """A finished choice's message: its content, and its reasoning when there is one to include."""
        reasoning, content = self.split(text)
        message = ChatResponseMessage(content=content)
        self.attach(message, reasoning)
        return message

    def attach(self, message: ChatResponseMessage | DeltaMessage, reasoning: str | None) -> None:
        """Put `reasoning` on a message or delta under both names, unless the request left it out."""
        if self.include and reasoning is not None:
            message.reasoning = message.reasoning_content = reasoning
