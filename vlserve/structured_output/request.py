"""One request's structured-output state: its constraint and the grammar being compiled for it off the step loop."""

from __future__ import annotations

from concurrent.futures import Future

from vlserve.structured_output.backend import StructuredOutputGrammar
from vlserve.structured_output.params import StructuredOutputsParams


class StructuredOutputRequest:
    """A request's constraint (`params`) and the future of its matcher (`future`); the scheduler polls
    `is_ready()` and schedules the request once the grammar is there (or aborts it when `error` is set)."""

    def __init__(self, params: StructuredOutputsParams, future: Future[StructuredOutputGrammar]) -> None:
        self.params = params
        self.future = future
        self._grammar: StructuredOutputGrammar | None = None  # the matcher, kept once compiled (read every step)

    def is_ready(self) -> bool:
        """True once compiling finished, successfully or not; never blocks."""
        return self.future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until compiling finished (a TimeoutError after timeout seconds); a failure is not raised here."""
        self.future.exception(timeout)

    @property
    def grammar(self) -> StructuredOutputGrammar | None:
        """The request's matcher; None while compiling or when compiling failed."""
        if self._grammar is None and self.future.done() and self.future.exception() is None:
            self._grammar = self.future.result()
        return self._grammar

    @property
    def error(self) -> str | None:
        """The compile error's message; None while compiling or when compiling succeeded."""
        if not self.future.done():
            return None
        exc = self.future.exception()
        return None if exc is None else (str(exc) or type(exc).__name__)

    def require_grammar(self) -> StructuredOutputGrammar:
        """The matcher; a RuntimeError while compiling or when compiling failed."""
        grammar = self._grammar or self.grammar
        if grammar is None:
            state = f"failed to compile: {self.error}" if self.is_ready() else "is still compiling"
            raise RuntimeError(f"the structured output grammar {state}")
        return grammar

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance the grammar over sampled tokens (see StructuredOutputGrammar.accept_tokens)."""
        return self.require_grammar().accept_tokens(tokens)

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of tokens (e.g. draft tokens) the grammar allows, without advancing it."""
        return self.require_grammar().validate_tokens(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (e.g. rejected draft tokens)."""
        self.require_grammar().rollback(num_tokens)

    def is_terminated(self) -> bool:
        """True once the grammar accepted the stop token."""
        return self.require_grammar().is_terminated()
