"""Stable block keys for the KV tiers: the same in every process and on every machine.

The device prefix cache keys blocks with Python's `hash()` of a tuple holding mm_hash strings, which differs per
process (PYTHONHASHSEED); a disk tier that outlives the process, or another server, needs a key that does not.
A key is blake2b (16 bytes) over the parent block's key (the namespace for the first block: the model, its dtype
and the block size), the block's token ids and its extra keys (the mm_hash of every media item overlapping it,
"lora:<id>"). Computed once per full block, only when a connector is on."""

from __future__ import annotations

import hashlib
from array import array

_ARRAY_CODE = "q"  # int64 token ids: one layout everywhere


def namespace_key(*parts: str) -> bytes:
    """The root of every chain: whatever makes a block's KV differ for the same tokens (model, weights, dtypes,
    block size, sharding)."""
    h = hashlib.blake2b(digest_size=16, person=b"vlserve-kv-ns")
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.digest()


def block_key(parent: bytes, token_ids, extra_keys: tuple[str, ...] = ()) -> bytes:
    """The key of one full block whose parent block (or namespace) has key `parent`."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array(_ARRAY_CODE, token_ids).tobytes())
    for e in extra_keys:
        h.update(b"\0")
        h.update(e.encode())
    return h.digest()


def extend_block_keys(request, num_blocks: int, block_size: int, namespace: bytes, extra_keys_of) -> list[bytes]:
    """Grow `request.block_keys` to cover its first `num_blocks` full blocks (never past its known tokens) and
    return it; `extra_keys_of(request, start, end)` gives a block's extra keys (the KV manager's rule)."""
    keys = request.block_keys
    num_blocks = min(num_blocks, request.num_tokens // block_size)
    tokens = request.all_token_ids
    while len(keys) < num_blocks:
        i = len(keys)
        start, end = i * block_size, (i + 1) * block_size
        keys.append(block_key(keys[-1] if keys else namespace, tokens[start:end], extra_keys_of(request, start, end)))
    return keys
