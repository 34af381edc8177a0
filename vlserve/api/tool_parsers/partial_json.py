"""Where the values of a JSON object (or of an array of objects) lie in a text that may still be growing.

Tool-call streaming needs the raw text of a value (a call's arguments) as it is written, and the same raw text once
the output is complete, so streamed fragments concatenate to exactly what a non-streamed response holds. Spans are
(start, end): `end` is None while the value is not finished. A text that cannot be JSON raises ValueError.
"""

from __future__ import annotations

import json
import re

_WS = " \t\r\n"
_CLOSERS = {"{": "}", "[": "]"}
_DELIMITERS = frozenset(",]}" + _WS)
_STRUCTURAL = re.compile(r'["{}\[\]]')

Span = tuple[int, "int | None"]


def skip_ws(text: str, i: int) -> int:
    """Index of the first non-whitespace character at or after i (len(text) if none)."""
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """End of the JSON string starting with the quote at text[i], or None when it is not closed yet."""
    j = i + 1
    while True:
        q = text.find('"', j)
        if q < 0:
            return None
        k = q - 1
        while k > i and text[k] == "\\":
            k -= 1
        if (q - 1 - k) % 2 == 0:  # an even number of backslashes: the quote is not escaped
            return q + 1
        j = q + 1


def value_end(text: str, i: int) -> int | None:
    """End of the JSON value starting at text[i] (a non-space character), or None when the text ends first."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in _CLOSERS:
        stack = [_CLOSERS[c]]
        j = i + 1
        while True:
            found = _STRUCTURAL.search(text, j)  # jump over plain characters at C speed
            if found is None:
                return None
            j = found.start()
            ch = text[j]
            if ch == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in _CLOSERS:
                stack.append(_CLOSERS[ch])
            elif ch != stack.pop():
                raise ValueError(f"mismatched {ch!r} at {j}")
            elif not stack:
                return j + 1
            j += 1
    j = i
    n = len(text)
    while j < n and text[j] not in _DELIMITERS:
        j += 1
    if j == n:
        return None  # a number or literal may go on
    json.loads(text[i:j])  # ValueError unless a number, true, false or null
    return j


def scan_object(text: str, i: int) -> tuple[dict[str, Span], int | None]:
    """The members of the object opening at text[i] that have begun, as {key: value span} (the first of duplicate
    keys), and the object's end (None while open)."""
    if text[i] != "{":
        raise ValueError(f"expected an object at {i}")
    fields: dict[str, Span] = {}
    n = len(text)
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        return fields, j + 1
    while j < n:
        if text[j] != '"':
            raise ValueError(f"expected a key at {j}")
        key_end = string_end(text, j)
        if key_end is None:
            return fields, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= n:
            return fields, None
        if text[j] != ":":
            raise ValueError(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if j >= n:
            return fields, None
        end = value_end(text, j)
        fields.setdefault(key, (j, end))
        if end is None:
            return fields, None
        j = skip_ws(text, end)
        if j >= n:
            return fields, None
        if text[j] == "}":
            return fields, j + 1
        if text[j] != ",":
            raise ValueError(f"expected ',' or '}}' at {j}")
        j = skip_ws(text, j + 1)
    return fields, None


def scan_object_array(text: str) -> list[dict[str, Span]]:
    """The members of each object of the array `text` holds (so far); ValueError if it is not such an array."""
    n = len(text)
    j = skip_ws(text, 0)
    if j >= n:
        return []
    if text[j] != "[":
        raise ValueError("expected an array")
    items: list[dict[str, Span]] = []
    j = skip_ws(text, j + 1)
    if j < n and text[j] == "]":
        return items
    while j < n:
        fields, end = scan_object(text, j)
        items.append(fields)
        if end is None:
            return items
        j = skip_ws(text, end)
        if j >= n or text[j] == "]":
            return items
        if text[j] != ",":
            raise ValueError(f"expected ',' or ']' at {j}")
        j = skip_ws(text, j + 1)
    return items


def string_value(text: str, span: Span | None) -> str | None:
    """The decoded string at a finished span, else None (also when the value is not a string)."""
    if span is None or span[1] is None:
        return None
    value = json.loads(text[span[0] : span[1]])
    return value if isinstance(value, str) else None


def raw_value(text: str, span: Span | None) -> str:
    """The raw text of a value so far ('' when it has not begun)."""
    if span is None:
        return ""
    return text[span[0] : span[1]] if span[1] is not None else text[span[0] :]
