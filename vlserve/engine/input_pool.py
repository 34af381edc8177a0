"""The input worker pool's pieces: its default size and a wrapper that serializes the multimodal processor."""
from __future__ import annotations

import threading
from typing import Any

DEFAULT_INPUT_WORKERS = 4


class SerializedProcessor:
    """Wraps the multimodal processor so that `process()` runs in one thread at a time (its cache is not
    thread-safe); every other attribute passes through."""

    def __init__(self, processor: Any):
        self._processor = processor
        self._lock = threading.Lock()

    def process(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._processor.process(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._processor, name)
