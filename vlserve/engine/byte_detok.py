"""Incremental detokenization of byte-level BPE tokenizers (GPT-2, Qwen, Llama 3) by a per-token bytes table.

A tokenizer whose decoder is a plain ByteLevel decodes a token list by concatenating each token's bytes and reading
them as UTF-8 (invalid bytes become U+FFFD), so its text grows by exactly the new tokens' bytes. `ByteTable` holds
every token id's bytes (empty for a special token when they are skipped, and for an id the tokenizer does not
know); `ByteStream` then emits what `tokenizers`' DecodeStream emits, token by token, without calling it: the bytes
gathered since the last emission, once they decode to text that does not end in U+FFFD.
"""

from __future__ import annotations


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: the character ByteLevel writes for each byte, back to the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class ByteTable:
    """Per token id its bytes, for the two settings of skip_special_tokens; built from the `tokenizers` backend."""

    def __init__(self, backend):
        # ByteLevel's characters to the latin-1 character of their byte; any other character below 256 to one that
        # latin-1 cannot encode, so a token holding a character outside the table fails and is read as UTF-8
        to_latin1 = {c: 0xFFFF for c in range(256)}
        to_latin1.update({ord(c): b for c, b in _unicode_to_byte().items()})
        size = backend.get_vocab_size(with_added_tokens=True)
        self.with_special: list[bytes] = [b""] * size
        for token, tid in backend.get_vocab(with_added_tokens=True).items():
            if 0 <= tid < size:
                try:  # as the ByteLevel decoder reads a token: through the table, or as UTF-8 when it cannot
                    self.with_special[tid] = token.translate(to_latin1).encode("latin-1")
                except UnicodeEncodeError:
                    self.with_special[tid] = token.encode()
        self.without_special = list(self.with_special)
        for tid, added in backend.get_added_tokens_decoder().items():
            if added.special and 0 <= tid < size:
                self.without_special[tid] = b""

    @staticmethod
    def build(backend) -> ByteTable | None:
        """The table of a backend whose decoder is a plain ByteLevel, else None (DecodeStream serves it)."""
        from tokenizers import decoders

        return ByteTable(backend) if isinstance(backend.decoder, decoders.ByteLevel) else None

    def bytes_of(self, skip_special_tokens: bool) -> list[bytes]:
        return self.without_special if skip_special_tokens else self.with_special


class ByteStream:
    """DecodeStream's `step` for a ByteLevel tokenizer: the new text of each token ("" until it completes one)."""

    __slots__ = ("table", "size", "pending")

    def __init__(self, table: list[bytes]):
        self.table = table
        self.size = len(table)
        self.pending = b""  # bytes since the last emitted text

    def step(self, token_id: int) -> str:
        piece = self.table[token_id] if 0 <= token_id < self.size else b""
        if not piece:
            return ""
        pending = self.pending + piece
        if _ends_unfinished(pending, len(pending)):  # (a dangling partial character, or an invalid byte: wait)
            self.pending = pending
            return ""
        self.pending = b""
        return pending.decode("utf-8", "replace")

    def extend(self, token_ids: list[int]) -> str:
        """The text `step` would emit over these tokens, joined. `step` emits at each token end where the bytes since
        its last emission decode to text not ending in U+FFFD; such an end leaves no partial character, so the pieces
        join to one decode of the bytes up to the last such end (searched from the back)."""
        try:  # (ids are never negative: sampled, or checked prompt ids)
            pieces = list(map(self.table.__getitem__, token_ids))
        except IndexError:  # an id past the tokenizer's vocabulary (a padded model vocabulary) has no bytes
            size = self.size
            pieces = [self.table[t] if t < size else b"" for t in token_ids]
        data = self.pending + b"".join(pieces)
        end = len(data)
        for piece in reversed(pieces):
            if piece and not _ends_unfinished(data, end):  # (a token with no bytes emits nothing)
                self.pending = data[end:]
                return data[:end].decode("utf-8", "replace")
            end -= len(piece)
        self.pending = data
        return ""


def _ends_unfinished(data: bytes, end: int) -> bool:
    """Whether `data[:end]` decodes (invalid bytes replaced) to text ending in U+FFFD. Only its last 4 bytes are
    read: the last character (or replaced run) of a decode spans at most 4 bytes and starts the same wherever the
    decode starts before it, so decoding those bytes alone ends as decoding from the start does."""
    if end and data[end - 1] < 0x80:  # an ASCII byte is never part of a longer character or a replaced run
        return False
    return data[max(0, end - 4) : end].decode("utf-8", "replace").endswith("\ufffd")
