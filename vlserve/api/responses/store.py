"""Stored responses (`store: true`) for `previous_response_id`, GET and DELETE /v1/responses/{id}.

In memory, per server process: at most `capacity` responses (`--responses-store-size`, default
DEFAULT_STORE_SIZE); storing one more evicts the least recently used (stored, retrieved, or continued from). A
restart forgets them all. An entry holds its conversation as sent, media data URLs included, so the memory the store
takes grows with the media of the conversations it keeps; `store: false` keeps nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from vlserve.api.responses.protocol import ResponseObject

DEFAULT_STORE_SIZE = 1000


@dataclass
class StoredResponse:
    """A finished response and the conversation it ends (chat messages without instructions, its output last)."""

    response: ResponseObject
    conversation: list[dict]


class ResponseStore:
    """An LRU map response id -> StoredResponse of at most `capacity` entries (0: nothing is kept)."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE):
        if capacity < 0:
            raise ValueError(f"the responses store size must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        """Keep `entry` as the most recently used; evict the least recently used beyond the capacity."""
        key = entry.response.id
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not stored."""
        return self._entries.pop(response_id, None) is not None
