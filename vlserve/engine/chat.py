"""OpenAI-format chat messages -> (messages for the chat template, media items in prompt order)."""
from __future__ import annotations

from typing import Any, Callable

from vlserve.engine.request_limits import check_role
from vlserve.shorten import shorten

_MEDIA_PART = {"image_url": "image", "image_pil": "image", "image": "image",
               "video_url": "video", "video": "video", "input_audio": "audio", "audio_url": "audio"}


def _url_of(part: dict, key: str) -> Any:
    value = part.get(key)
    if isinstance(value, dict):
        return value.get("url")
    return value


def default_media_source(part_type: str, part: dict) -> Any:
    """What to hand the media loader for one content part: a URL string, a path, PIL image, array, or frames."""
    if part_type in ("image_url", "video_url", "audio_url"):
        url = _url_of(part, part_type)
        if not isinstance(url, str) or not url:
            raise ValueError(f"content part '{part_type}' needs a non-empty url")
        if url.startswith("file://"):
            return url[len("file://"):]
        if url.startswith(("http://", "https://")):
            raise ValueError(f"{part_type} {url!r}: http(s) media is fetched by the server; in the offline API pass "
                             f"a data: URL, a file:// URL, a path or the media itself")
        return url
    if part_type == "input_audio":
        audio = part.get("input_audio") or {}
        return audio.get("data")
    return part.get(part_type)


def parse_chat_messages(messages: list[dict], media_source: Callable[[str, dict], Any] = default_media_source
                        ) -> tuple[list[dict], dict[str, list]]:
    """Validate messages; media parts become {"type": <part type>} placeholders for the chat template and their
    payloads are collected per modality, in order of appearance."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out_messages: list[dict] = []
    mm_data: dict[str, list] = {}
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise ValueError(f"message {i} must be a dict with a 'role'")
        check_role(msg["role"], f"message {i}")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            out_messages.append({"role": msg["role"], "content": content or ""})
            continue
        if not isinstance(content, list):
            raise ValueError(f"message {i} content must be a string or a list of content parts")
        parts = []
        for j, part in enumerate(content):
            ptype = part.get("type") if isinstance(part, dict) else None
            if ptype == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"message {i} part {j}: a text part needs a 'text' string")
                parts.append({"type": "text", "text": part["text"]})
            elif ptype in _MEDIA_PART:
                mm_data.setdefault(_MEDIA_PART[ptype], []).append(media_source(ptype, part))
                parts.append({"type": ptype})
            else:
                raise ValueError(f"message {i} part {j}: unsupported content part type {shorten(ptype)}")
        out_messages.append({"role": msg["role"], "content": parts})
    return out_messages, mm_data
