"""OpenAI-format chat messages -> (messages for the chat template, media items in prompt order).

Chat templates take message content in one of two shapes (vLLM's "content format"):
- "openai": content is a list of parts, media as {"type": "image" | "video" | "audio"}, text as
  {"type": "text", "text": ...} (what HF's multimodal templates, e.g. Qwen2-VL's, loop over);
- "string": content is one string; media become the model's placeholder strings in front of the text.
"auto" finds out which one a template takes by reading its Jinja syntax tree (cached per template).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from vlserve.engine.request_limits import check_role
from vlserve.multimodal.audio import input_audio_data_url
from vlserve.multimodal.media_refs import NamedItem, check_uuid, decode_image_embeds
from vlserve.shorten import shorten

CONTENT_FORMATS = ("auto", "string", "openai")

_MEDIA_PART = {
    "image_url": "image",
    "image_pil": "image",
    "image": "image",
    "video_url": "video",
    "video": "video",
    "input_audio": "audio",
    "audio_url": "audio",
    "image_embeds": "image",
}

# What a string-only template gets for each media item (Qwen2-VL's vision markers; Qwen2-Audio's audio markers).
MEDIA_PLACEHOLDERS = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
    "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
}


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
            return url[len("file://") :]
        if url.startswith(("http://", "https://")):
            raise ValueError(
                f"{part_type} {url[:100]!r}: http(s) media is fetched by the server; in the offline API "
                f"pass a data: URL, a file:// URL, a path or the media itself"
            )
        return url
    if part_type == "input_audio":
        return input_audio_data_url(part.get("input_audio"))
    if part_type == "image_embeds":
        return decode_image_embeds(part.get("image_embeds"))
    return part.get(part_type)


def is_name_only(part: dict) -> bool:
    """A media part that carries a `uuid` and no media: it asks for the item cached under that name."""
    ptype = part.get("type")
    if part.get("uuid") is None or ptype not in _MEDIA_PART:
        return False
    return (_url_of(part, ptype) if ptype.endswith("_url") else part.get(ptype)) is None


def _media_item(ptype: str, part: dict, media_source: Callable[[str, dict], Any]) -> Any:
    """A media part's item for the processor: its payload, wrapped in a NamedItem when the part has a `uuid`."""
    if part.get("uuid") is None:
        return media_source(ptype, part)
    if ptype == "image_embeds":
        raise ValueError("image_embeds parts take no uuid (their content is their key)")
    return NamedItem(check_uuid(part["uuid"]), None if is_name_only(part) else media_source(ptype, part))


def parse_chat_messages(
    messages: list[dict], media_source: Callable[[str, dict], Any] = default_media_source
) -> tuple[list[dict], dict[str, list]]:
    """Validate messages; media parts become {"type": "image" | "video" | "audio"} parts (the "openai" content
    format) and their payloads are collected per modality, in order of appearance."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out_messages: list[dict] = []
    mm_data: dict[str, list] = {}
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise ValueError(f"message {i} must be a dict with a 'role'")
        check_role(msg["role"], f"message {i}")
        content = msg.get("content")
        fields = _tool_fields(msg, i)
        if content is None or isinstance(content, str):
            out_messages.append({"role": msg["role"], "content": content or "", **fields})
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
                modality = _MEDIA_PART[ptype]
                mm_data.setdefault(modality, []).append(_media_item(ptype, part, media_source))
                parts.append({"type": modality})
            else:
                raise ValueError(f"message {i} part {j}: unsupported content part type {shorten(ptype)}")
        out_messages.append({"role": msg["role"], "content": parts, **fields})
    return out_messages, mm_data


def _tool_fields(msg: dict, i: int) -> dict:
    """A message's `name`, an assistant's `tool_calls` (arguments as objects: HF templates print them with tojson)
    and a tool message's `tool_call_id`, checked."""
    out: dict[str, Any] = {}
    if msg.get("name") is not None:
        if not isinstance(msg["name"], str):
            raise ValueError(f"message {i}: name must be a string")
        out["name"] = msg["name"]
    calls = msg.get("tool_calls")
    if calls is not None:
        if msg["role"] != "assistant":
            raise ValueError(f"message {i}: only assistant messages carry tool_calls")
        if not isinstance(calls, list):
            raise ValueError(f"message {i}: tool_calls must be a list")
        out["tool_calls"] = [_template_tool_call(call, f"message {i} tool_calls[{j}]") for j, call in enumerate(calls)]
    call_id = msg.get("tool_call_id")
    if call_id is not None:
        if msg["role"] != "tool":
            raise ValueError(f"message {i}: only tool messages carry tool_call_id")
        if not isinstance(call_id, str):
            raise ValueError(f"message {i}: tool_call_id must be a string")
        out["tool_call_id"] = call_id
    return out


def _template_tool_call(call: Any, where: str) -> dict:
    """An OpenAI tool call {id, type, function: {name, arguments: JSON text}} with its arguments parsed."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function":
        raise ValueError(
            f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., "arguments": ...}}}}'
        )
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    arguments = fn.get("arguments")
    if arguments is None or isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments and arguments.strip() else {}
        except ValueError:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {shorten(arguments)}") from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def flatten_content(parts: list[dict], placeholders: dict[str, str] = MEDIA_PLACEHOLDERS) -> str:
    """One message's parts as a string, as vLLM builds it: the placeholder of each media item the text does not
    already hold, then the texts, all joined by newlines."""
    text = "\n".join(p["text"] for p in parts if p["type"] == "text")
    missing: list[str] = []
    seen: dict[str, int] = {}
    for part in parts:
        if part["type"] == "text":
            continue
        placeholder = placeholders[part["type"]]
        seen[placeholder] = seen.get(placeholder, 0) + 1
        if seen[placeholder] > text.count(placeholder):
            missing.append(placeholder)
    return "\n".join(missing + [text])


def to_content_format(
    messages: list[dict], content_format: str, placeholders: dict[str, str] = MEDIA_PLACEHOLDERS
) -> list[dict]:
    """Messages from `parse_chat_messages` in the shape a template with `content_format` expects."""
    if content_format == "openai":
        return messages
    if content_format != "string":
        raise ValueError(f"content format must be 'string' or 'openai', got {shorten(content_format)}")
    return [
        {**m, "content": m["content"] if isinstance(m["content"], str) else flatten_content(m["content"], placeholders)}
        for m in messages
    ]


def resolve_content_format(requested: str, chat_template: Any) -> str:
    """'string' or 'openai': `requested` unless it is 'auto', then what the template's syntax shows."""
    if requested not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got {shorten(requested)}"
        )
    if requested != "auto":
        return requested
    if isinstance(chat_template, dict):  # named templates: transformers renders the "default" one
        chat_template = chat_template.get("default")
    if not isinstance(chat_template, str):
        return "openai"
    return detect_content_format(chat_template)


@functools.lru_cache(maxsize=64)
def detect_content_format(chat_template: str) -> str:
    """'openai' when the template loops over or indexes a message's content (a list of parts), else 'string'.
    A template the parser cannot read counts as 'openai' (what vlserve always handed templates before)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return "openai"
    return "openai" if _uses_content_as_list(tree) else "string"


def _uses_content_as_list(tree) -> bool:
    """Track names bound to the message list, to one message and to its content through assignments and loops;
    then look for a loop over content or a subscript of it by position."""
    from jinja2 import nodes

    lists, items, contents = {"messages"}, set(), set()

    def is_list(n) -> bool:
        if isinstance(n, nodes.Filter):  # messages | selectattr(...) etc.
            return n.node is not None and is_list(n.node)
        if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Slice):
            return is_list(n.node)
        return isinstance(n, nodes.Name) and n.name in lists

    def is_item(n) -> bool:
        if isinstance(n, nodes.Getitem) and not isinstance(n.arg, nodes.Slice):
            return is_list(n.node)
        return isinstance(n, nodes.Name) and n.name in items

    def is_content(n) -> bool:
        if isinstance(n, nodes.Filter):
            return n.node is not None and is_content(n.node)
        if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const) and n.arg.value == "content":
            return is_item(n.node)
        if isinstance(n, nodes.Getattr) and n.attr == "content":
            return is_item(n.node)
        return isinstance(n, nodes.Name) and n.name in contents

    # (name bound, expression, bound by a for loop?) for every `set` and `for` in the template
    bindings = [(a.target, a.node, False) for a in tree.find_all(nodes.Assign)]
    bindings += [(f.target, f.iter, True) for f in tree.find_all(nodes.For)]
    for _ in range(4):  # aliases of aliases: a few passes reach a fixed point for real templates
        for target, value, by_loop in bindings:
            if not isinstance(target, nodes.Name):
                continue
            if is_list(value):
                (items if by_loop else lists).add(target.name)
            elif is_item(value) and not by_loop:
                items.add(target.name)
            elif is_content(value) and not by_loop:
                contents.add(target.name)
    if any(is_content(f.iter) for f in tree.find_all(nodes.For)):
        return True
    return any(
        is_content(g.node) and isinstance(g.arg, nodes.Const) and isinstance(g.arg.value, int)
        for g in tree.find_all(nodes.Getitem)
    )
