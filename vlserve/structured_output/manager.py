"""The engine's entry to structured outputs: compiles constraints on a thread pool (with a cache), hands each request
its own matcher, and builds the per-step token bitmask, speculative draft positions included."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from vlserve.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar, constraint_text
from vlserve.structured_output.params import StructuredOutputsConfig, StructuredOutputsParams
from vlserve.structured_output.request import StructuredOutputRequest

# (backend name, kind, constraint_text, any_whitespace): what one compiled grammar depends on
CacheKey = tuple[str, str, str, bool]
MAX_CACHED_GRAMMARS = 1024
MAX_TOKENS_TRIED = 16  # validate(): with more allowed first tokens than this, the grammar is taken to start


def make_backend(
    tokenizer, vocab_size: int, config: StructuredOutputsConfig, stop_token_ids: list[int] | None = None
) -> StructuredOutputBackend:
    """The backend config.backend names, built for this tokenizer, logits width and stop tokens."""
    if config.backend == "guidance":
        from vlserve.structured_output.backend_guidance import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, config, stop_token_ids)
    from vlserve.structured_output.backend_xgrammar import XgrammarBackend

    return XgrammarBackend(tokenizer, vocab_size, config, stop_token_ids)


class StructuredOutputManager:
    """Compiles constraints off the caller's thread and fills token bitmasks for a batch.

    Compiled grammars are cached by CacheKey (least recently used out past MAX_CACHED_GRAMMARS); a constraint that
    is compiling already is not compiled twice, and each request gets a fresh matcher over the shared result.
    `num_compiles` counts the compiles actually run. vocab_size: the model's logits width; stop_token_ids: the
    checkpoint's EOS ids (None: the tokenizer's eos_token_id)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        config: StructuredOutputsConfig | None = None,
        *,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        self.config = StructuredOutputsConfig.from_any(config)
        self.vocab_size = vocab_size
        self.backend = make_backend(tokenizer, vocab_size, self.config, stop_token_ids)
        self.num_compiles = 0
        self._executor = ThreadPoolExecutor(self.config.compile_workers, thread_name_prefix="vlserve-grammar")
        self._lock = threading.Lock()
        self._compiled: OrderedDict[CacheKey, Future] = OrderedDict()

    def cache_key(self, params: StructuredOutputsParams) -> CacheKey:
        """What the compiled grammar for params depends on."""
        return (self.backend.name, params.kind, constraint_text(params), self.backend.any_whitespace(params))

    def init_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start compiling params on the pool (or reuse the cache) and return at once; the request is ready when
        its matcher exists or compiling failed."""
        compiled = self._compiled_future(params, compile_here=False)
        grammar_future: Future[StructuredOutputGrammar] = Future()

        def make_matcher(done: Future) -> None:
            if not grammar_future.set_running_or_notify_cancel():
                return
            try:
                grammar_future.set_result(self.backend.new_grammar(done.result()))
            except BaseException as e:  # the compile error (a ValueError), or a cancelled compile at shutdown
                grammar_future.set_exception(e)

        compiled.add_done_callback(make_matcher)
        return StructuredOutputRequest(params, grammar_future)

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile params now, through the cache; a ValueError with the compiler's message when it does not
        compile, or when the constraint accepts no string (its matcher allows no token at the start)."""
        grammar = self.backend.new_grammar(self._compiled_future(params, compile_here=True).result())
        if not can_start(grammar, self.backend.allocate_bitmask(1), self.vocab_size):
            raise ValueError(f"structured outputs {params.kind}: the constraint accepts no string")

    def grammar_bitmask(self, requests: list[StructuredOutputRequest | None], drafts: list[list[int]]) -> np.ndarray:
        """The allowed tokens of every position the model scores this step: int32 [sum(len(d) + 1), words].

        Per request, in order: one row per draft token position, then the bonus position. An unconstrained
        request (None) gets rows of -1. A constrained one is walked along its drafts (fill a row, accept the
        draft token, fill the next row, ...) and rolled back afterwards, so its state is unchanged; a draft
        token the grammar refuses (drafts should have been validated) leaves the request's later rows at -1."""
        if len(requests) != len(drafts):
            raise ValueError(f"grammar_bitmask got {len(requests)} requests but {len(drafts)} draft lists")
        bitmask = self.backend.allocate_bitmask(sum(len(draft) + 1 for draft in drafts))  # [rows, words], all -1
        first_row = 0
        for request, draft in zip(requests, drafts):
            if request is not None:
                fill_draft_rows(request.require_grammar(), draft, bitmask, first_row)
            first_row += len(draft) + 1
        return bitmask.numpy()

    def shutdown(self) -> None:
        """Stop the compile threads; compiles not yet started are cancelled (their requests get an error)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            pending = list(self._compiled.values())
        for future in pending:
            future.cancel()

    def _compiled_future(self, params: StructuredOutputsParams, compile_here: bool) -> Future:
        """The cached future of params' compiled grammar; a miss compiles on this thread or on the pool."""
        key = self.cache_key(params)
        with self._lock:
            future = self._compiled.get(key)
            if future is not None:
                self._compiled.move_to_end(key)
                return future
            future = Future()
            self._compiled[key] = future
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            self.num_compiles += 1
        if compile_here:
            self._run_compile(key, future)
            return future
        try:
            self._executor.submit(self._run_compile, key, future)
        except RuntimeError:  # the pool is shut down: forget the entry instead of leaving it pending forever
            with self._lock:
                self._compiled.pop(key, None)
            future.cancel()
            raise
        return future

    def _run_compile(self, key: CacheKey, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        _, kind, spec, any_whitespace = key
        try:
            future.set_result(self.backend.compile_constraint(kind, spec, any_whitespace))
        except BaseException as e:
            if not isinstance(e, ValueError):  # not the compiler's verdict on the constraint: do not keep it
                with self._lock:
                    if self._compiled.get(key) is future:
                        del self._compiled[key]
            future.set_exception(e)


def can_start(grammar: StructuredOutputGrammar, row_buffer: torch.Tensor, vocab_size: int) -> bool:
    """Whether a fresh matcher can take a first token. A few allowed ids are tried one by one: llguidance allows
    EOS in a grammar that can go nowhere, xgrammar only in one that is complete."""
    grammar.fill_bitmask(row_buffer, 0)
    words = row_buffer[0].numpy().astype("<i4", copy=False)  # [words]
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size])
    if len(allowed) > MAX_TOKENS_TRIED:
        return True
    return any(grammar.validate_tokens([int(token)]) for token in allowed)


def fill_draft_rows(grammar: StructuredOutputGrammar, draft: list[int], bitmask: torch.Tensor, first_row: int) -> None:
    """Fill bitmask rows first_row .. first_row + len(draft) for one request (draft positions, then the bonus
    position), accepting each draft token on the way and rolling them all back at the end."""
    accepted = 0
    for position in range(len(draft) + 1):
        grammar.fill_bitmask(bitmask, first_row + position)
        if position == len(draft) or not grammar.accept_tokens([draft[position]]):
            break
        accepted += 1
    grammar.rollback(accepted)
