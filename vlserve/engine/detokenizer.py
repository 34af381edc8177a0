"""Incremental detokenization and stop-string detection for one output sequence."""

from __future__ import annotations

from vlserve.engine.byte_detok import ByteStream, ByteTable

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside the output so leading spaces come out right


class IncrementalDetokenizer:
    """Emits only the new, complete (no dangling UTF-8) text of each step.

    Byte-level BPE tokenizers given a `byte_table` (byte_detok.py) read each token's bytes from it; other fast
    tokenizers use the `tokenizers` library's DecodeStream (incremental, in Rust); either is primed with the prompt's
    last tokens. Others keep a sliding window of ids and decode it twice per token. With a byte table and no stop
    strings nothing needs the text between reads: `update` only queues the ids, and reading `output_text` decodes
    the queue in one go (the same text; a request whose outputs are read only at its end decodes once).
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        byte_table: ByteTable | None = None,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self._text = ""
        self._queued: list[int] = []  # ids not decoded yet (byte table, no stop strings)
        self._stream = None
        self._bytes: ByteStream | None = None
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        backend = getattr(tokenizer, "_tokenizer", None)
        if byte_table is not None:
            self._bytes = ByteStream(byte_table.bytes_of(skip_special_tokens))
            self._bytes.extend(self._ids)  # (what stepping through them leaves pending; their text is dropped)
        elif backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for tok in self._ids:
                self._stream.step(backend, tok)

    @property
    def output_text(self) -> str:
        """The text so far (decoding the queued ids first)."""
        if self._queued:
            self._text += self._bytes.extend(self._queued)
            self._queued = []
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears in the text (the text is cut there)."""
        if self._bytes is not None:  # (a table lookup per token: it never fails)
            if not self.stop:
                self._queued += new_token_ids
                return None
            start_len = len(self._text)
            step = self._bytes.step
            for tok in new_token_ids:
                piece = step(tok)
                if piece:
                    self._text += piece
            return self._check_stop(start_len)
        start_len = len(self._text)
        if self._stream is not None and len(new_token_ids) == 1:  # the usual step: one token
            tok = new_token_ids[0]
            try:
                piece = self._stream.step(self._backend, tok)
            except Exception:  # the stream rejected it: the windowed path from here, as below
                self._stream = None
            else:
                self._ids.append(tok)
                if piece:
                    self._text += piece
                    self._prefix_offset = self._read_offset = len(self._ids)
                return self._check_stop(start_len) if self.stop else None
        if self._stream is not None:
            try:
                for i, tok in enumerate(new_token_ids):  # noqa: B007  (i: where the except goes on)
                    piece = self._stream.step(self._backend, tok)
                    self._ids.append(tok)
                    if piece:
                        self._text += piece
                        self._prefix_offset = self._read_offset = len(self._ids)
                return self._check_stop(start_len) if self.stop else None
            except Exception:  # the stream rejected a sequence: continue on the windowed path from here
                self._stream = None
                new_token_ids = new_token_ids[i:]
        for tok in new_token_ids:
            self._ids.append(tok)
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self._text += full[len(prefix) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        return self._check_stop(start_len)

    def _check_stop(self, start_len: int) -> str | None:
        if not self.stop or len(self._text) == start_len:
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            # Only text that could contain a new match: the new part plus len(s) - 1 characters before it.
            idx = self._text.find(s, max(0, start_len - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self._text = self._text[: idx + len(s) if self.include_stop else idx]
        return s
