"""`DPRouter`: which data-parallel replica (engine process) a new request goes to. Pure Python, no I/O.

Affinity first: a request with an affinity key (a live video session's id) goes to the replica that key picks, one
with media to the replica its first item's content hash (mm_hash) picks, one
without to the replica the hash of its first `block_size * prefix_blocks` prompt tokens picks, so the same image or
the same system prompt lands where its encoder-cache / prefix-cache entries already are. Load second: the router
counts the sequences it sent to each replica and has not seen finish; when the affinity replica holds more than
`2 * least + margin` of them, the request goes to the least loaded replica instead (lowest index on ties). The
margin defaults to the engine's `max_num_seqs`: until the affinity replica's batch is full, staying costs no
queueing, so a cache hit is worth more than an idle replica.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_PREFIX_BLOCKS = 4  # affinity key for text: the first 4 KV blocks of the prompt


def _stable_hash(data: bytes) -> int:
    """The same integer in every process and run (Python's hash() of str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass
class DPRouter:
    """Routes requests over `num_replicas` replicas and remembers which replica holds each open request."""

    num_replicas: int
    margin: int
    block_size: int = 16
    prefix_blocks: int = DEFAULT_PREFIX_BLOCKS
    loads: list[int] = field(init=False)  # open sequences per replica, as routed here
    _owners: dict[str, tuple[int, int]] = field(init=False, default_factory=dict)  # request id -> (replica, seqs)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.margin < 0 or self.block_size < 1 or self.prefix_blocks < 1:
            raise ValueError("margin must be >= 0, block_size and prefix_blocks >= 1")
        self.loads = [0] * self.num_replicas

    def affinity_replica(
        self, prompt_token_ids: Sequence[int], mm_hashes: Sequence[str] = (), affinity: str | None = None
    ) -> int:
        """The replica this request's cacheable content maps to: its affinity key, else its first media item, else
        its prompt prefix."""
        if self.num_replicas == 1:
            return 0
        if affinity is not None:
            key = b"key:" + affinity.encode()
        elif mm_hashes:
            key = b"mm:" + mm_hashes[0].encode()
        else:
            prefix = prompt_token_ids[: self.block_size * self.prefix_blocks]
            key = b"tok:" + array("q", prefix).tobytes()
        return _stable_hash(key) % self.num_replicas

    def choose(
        self, prompt_token_ids: Sequence[int], mm_hashes: Sequence[str] = (), affinity: str | None = None
    ) -> int:
        """The affinity replica, unless it holds more than 2x the least loaded one's sequences plus the margin."""
        replica = self.affinity_replica(prompt_token_ids, mm_hashes, affinity)
        least = min(range(self.num_replicas), key=lambda i: (self.loads[i], i))
        if self.loads[replica] > 2 * self.loads[least] + self.margin:
            return least
        return replica

    def route(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        mm_hashes: Sequence[str] = (),
        num_seqs: int = 1,
        affinity: str | None = None,
    ) -> int:
        """Choose a replica for a new request (of `num_seqs` sequences) and count it there until `release`."""
        if request_id in self._owners:
            raise ValueError(f"request id {request_id[:64]!r} is already routed")
        replica = self.choose(prompt_token_ids, mm_hashes, affinity)
        self._owners[request_id] = (replica, num_seqs)
        self.loads[replica] += num_seqs
        return replica

    def owner(self, request_id: str) -> int | None:
        """The replica holding an open request (None when it is not open)."""
        entry = self._owners.get(request_id)
        return None if entry is None else entry[0]

    def release(self, request_id: str) -> int | None:
        """The request finished or was dropped: stop counting it; its replica, or None when it was not open."""
        entry = self._owners.pop(request_id, None)
        if entry is None:
            return None
        self.loads[entry[0]] -= entry[1]
        return entry[0]

    @property
    def open_requests(self) -> int:
        return len(self._owners)
