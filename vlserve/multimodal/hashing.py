"""Content hashes of media items: identical pixels + identical processor kwargs => identical mm_hash.

The hash keys the processor cache, the encoder cache and (through the KV manager's block hashes) prefix caching
of multimodal prompts, so it covers everything that changes the encoder output: modality, pixel bytes, shape,
dtype and the processor kwargs (for videos, the frame sampling too: `fps`, `num_frames`, `max_frames`).
An item the client named (`uuid`) is keyed by its name and the same kwargs instead of its content.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import numpy as np


def _update_array(h: hashlib._Hash, arr: np.ndarray) -> None:
    arr = np.ascontiguousarray(arr)
    h.update(f"ndarray|{arr.dtype.str}|{arr.shape}|".encode())
    h.update(memoryview(arr).cast("B") if arr.size else b"")


def _update(h: hashlib._Hash, item: Any) -> None:
    """Feed one item (array, PIL image, bytes, tensor, LoadedVideo or a list of those) into the hash."""
    from PIL import Image

    if isinstance(item, np.ndarray):
        _update_array(h, item)
    elif isinstance(item, Image.Image):
        h.update(f"pil|{item.mode}|".encode())
        _update_array(h, np.asarray(item))
    elif isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
        h.update(f"bytes|{len(data)}|".encode())
        h.update(data)
    elif isinstance(item, str):
        data = item.encode()
        h.update(f"str|{len(data)}|".encode())
        h.update(data)
    elif hasattr(item, "frames") and hasattr(item, "sampled_fps"):  # media.LoadedVideo
        h.update(f"video|fps={item.sampled_fps!r}|".encode())
        _update_array(h, item.frames)
    elif hasattr(item, "detach") and hasattr(item, "cpu"):  # torch.Tensor, without importing torch
        _update_array(h, item.detach().cpu().contiguous().numpy())
    elif isinstance(item, (list, tuple)):
        h.update(f"seq|{len(item)}|".encode())
        for sub in item:
            _update(h, sub)
    else:
        raise TypeError(f"cannot hash media item of type {type(item).__name__}")


def _canonical_kwargs(kwargs: dict | None) -> str:
    """Deterministic text form of processor kwargs (sorted keys; non-JSON values by repr)."""
    return json.dumps(kwargs or {}, sort_keys=True, default=repr, separators=(",", ":"))


def _content_digest(modality: str, feed: Callable[[hashlib._Hash], None], processor_kwargs: dict | None) -> str:
    h = hashlib.blake2b(digest_size=32)
    h.update(f"vlserve-mm-v1|{modality}|".encode())
    feed(h)
    h.update(b"|kwargs|")
    h.update(_canonical_kwargs(processor_kwargs).encode())
    return h.hexdigest()


def hash_mm_item(modality: str, item: Any, processor_kwargs: dict | None = None) -> str:
    """Return a hex blake2b-256 digest of (modality, item content incl. shape/dtype, sorted processor kwargs)."""
    return _content_digest(modality, lambda h: _update(h, item), processor_kwargs)


def hash_pil_pixels(mode: str, pixels: np.ndarray, processor_kwargs: dict | None = None) -> str:
    """`hash_mm_item("image", img, processor_kwargs)` of a PIL image `img` in `mode` whose `np.asarray(img)` is
    `pixels`, computed from those pixels (for a caller that holds them already: PIL copies its pixels out anew on
    every array conversion)."""

    def feed(h: hashlib._Hash) -> None:
        h.update(f"pil|{mode}|".encode())
        _update_array(h, pixels)

    return _content_digest("image", feed, processor_kwargs)


def hash_named_item(modality: str, uuid: str, processor_kwargs: dict | None = None) -> str:
    """The mm_hash of an item the client named (a content part's `uuid`): the name stands for the content, so the
    digest covers (modality, name, sorted processor kwargs) and never equals a content hash."""
    h = hashlib.blake2b(digest_size=32)
    h.update(f"vlserve-mm-uuid-v1|{modality}|{len(uuid)}|".encode())
    h.update(uuid.encode())
    h.update(b"|kwargs|")
    h.update(_canonical_kwargs(processor_kwargs).encode())
    return h.hexdigest()
