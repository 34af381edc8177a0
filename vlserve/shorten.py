"""`shorten()`: how a user-supplied value appears inside an error message (quoted, escaped, cut short)."""

from __future__ import annotations

from typing import Any

DEFAULT_LIMIT = 60


def shorten(value: Any, limit: int = DEFAULT_LIMIT) -> str:
    """`repr(value)` with control characters and lone surrogates escaped, cut to about `limit` characters.

    Never echoes a huge value back, and the result is always valid UTF-8 (safe in a JSON error body).
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value[: limit + 1])
    elif isinstance(value, str) and len(value) > limit:
        text = repr(value[:limit])
        return f"{text}... ({len(value)} characters)"
    elif isinstance(value, (list, tuple, dict, set)) and len(value) > limit:
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 -- a hostile __repr__ must not break error reporting
        return f"<{type(value).__name__}>"
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."
