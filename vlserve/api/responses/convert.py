"""A Responses request -> the chat request the chat endpoint's input side runs (messages, tools, tool_choice,
output constraint, sampling), and a finished output -> chat messages for the next turn's history.

Input items: a string is one user message; a list holds
- messages ({"type": "message"} or no type; role user / system / developer / assistant) whose content is a string or
  parts: input_text / output_text (text), input_image (`image_url` as URL or data URL, `detail` "auto" / "low" /
  "high" accepted, `file_id` refused), input_audio ({"data", "format"}), input_file (`file_data` or `file_url` whose
  media type is image/*, audio/* or video/*, taken as that media; any other file is refused), refusal (text);
- function_call items (consecutive ones become one assistant message's tool_calls) and function_call_output items
  (a tool message answering `call_id`);
- reasoning items (earlier output): not sent to the chat template, as chat templates drop past reasoning.
`instructions` become a leading system message and are not carried into a later turn (as OpenAI does).
"""

from __future__ import annotations

from typing import Any

from vlserve.api.errors import APIError
from vlserve.api.protocol import ChatCompletionRequest
from vlserve.api.responses.protocol import FunctionCallItem, MessageItem, OutputItem, ResponsesRequest
from vlserve.shorten import shorten

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "refusal")
_DETAILS = (None, "auto", "low", "high")
_JSON_SCHEMA_KEYS = ("name", "schema", "description", "strict")
_FILE_MEDIA = {"image/": "image_url", "audio/": "audio_url", "video/": "video_url"}


def _bad(message: str) -> APIError:
    return APIError(message, 400, "input")


def _text_of(part: dict, where: str) -> str:
    key = "refusal" if part["type"] == "refusal" else "text"
    text = part.get(key)
    if not isinstance(text, str):
        raise _bad(f"{where}.{key} must be a string")
    return text


def _image_part(part: dict, where: str) -> dict:
    if part.get("file_id") is not None:
        raise _bad(f"{where}: file_id is not supported (this server has no file store); send image_url")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise _bad(f"{where}.image_url must be a URL or a data URL")
    if part.get("detail") not in _DETAILS:
        raise _bad(f"{where}.detail must be one of auto, low, high; got {shorten(part.get('detail'))}")
    return {"type": "image_url", "image_url": {"url": url}}


def _audio_part(part: dict, where: str) -> dict:
    audio = part.get("input_audio")
    if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
        raise _bad(f'{where}.input_audio must be {{"data": <base64>, "format": "wav" | "mp3"}}')
    return {"type": "input_audio", "input_audio": audio}


def _file_part(part: dict, where: str) -> dict:
    """An input_file whose data (or URL) is media the chat path takes; anything else is refused."""
    if part.get("file_id") is not None:
        raise _bad(f"{where}: file_id is not supported (this server has no file store); send file_data")
    url = part.get("file_data") or part.get("file_url")
    if not isinstance(url, str) or not url:
        raise _bad(f"{where}: input_file needs file_data (a data URL) or file_url")
    media_type = url[5:].split(";", 1)[0].split(",", 1)[0] if url.startswith("data:") else ""
    for prefix, kind in _FILE_MEDIA.items():
        if media_type.startswith(prefix):
            return {"type": kind, kind: {"url": url}}
    what = media_type or "a file URL"
    raise _bad(
        f"{where}: input_file of {shorten(what)} is not supported; this server takes files that are images, "
        f"audio or video (as data URLs with that media type), as the model allows"
    )


_PARTS = {"input_image": _image_part, "input_audio": _audio_part, "input_file": _file_part}


def _content(content: Any, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": _text_of(part, here)})
        elif kind in _PARTS:
            parts.append(_PARTS[kind](part, here))
        else:
            known = ", ".join((*_TEXT_PARTS, *_PARTS))
            raise _bad(f"{here}: content part type {shorten(kind)} is not supported; supported: {known}")
    return parts


def _function_call(item: dict, where: str) -> dict:
    name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not isinstance(name, str) or not name or not isinstance(arguments, str) or not isinstance(call_id, str):
        raise _bad(f"{where}: a function_call item needs call_id, name and arguments (JSON text) as strings")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def input_messages(items: str | list[dict]) -> list[dict]:
    """Chat messages of a request's `input` (APIError 400 naming the bad item)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"{where}.role must be one of {', '.join(_ROLES)}; got {shorten(role)}")
            messages.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise _bad(f"{where}: a function_call_output item needs call_id and output as strings")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":
            raise _bad(
                f"{where}: input item type {shorten(kind)} is not supported; supported: message, function_call, "
                f"function_call_output, reasoning"
            )
    if not messages:
        raise _bad("input holds no message")
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools ({"type": "function", "name", ...}) in the chat form; other tool types refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise APIError(f"tools[{i}]: tool type {shorten(kind)} is not supported; only function tools are", 400)
        extra = [k for k in tool if k not in ("type", "name", "description", "parameters", "strict")]
        if extra:
            raise APIError(f"tools[{i}]: unsupported field(s) {', '.join(shorten(k) for k in extra)}", 400, "tools")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """A Responses tool_choice ("none" / "auto" / "required" / {"type": "function", "name"}) in the chat form."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict | None) -> dict | None:
    """`text.format` as a chat response_format (json_schema's name / schema / strict / description move under
    "json_schema"); ValueError for other keys."""
    if text is None:
        return None
    extra = [k for k in text if k not in ("format", "verbosity")]
    if extra:
        raise ValueError(f"text: unsupported field(s) {', '.join(shorten(k) for k in extra)}; supported: format")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValueError(f"text.format must be an object, got {shorten(fmt)}")
    if fmt.get("type") != "json_schema":
        return dict(fmt)  # text / json_object: checked with the chat request's response_format
    extra = [k for k in fmt if k not in ("type", *_JSON_SCHEMA_KEYS)]
    if extra:
        raise ValueError(
            f"text.format json_schema: unsupported field(s) {', '.join(shorten(k) for k in extra)}; supported: "
            f"type, {', '.join(_JSON_SCHEMA_KEYS)}"
        )
    if not isinstance(fmt.get("name"), str):
        raise ValueError("text.format.name must be a string")
    if not isinstance(fmt.get("schema"), dict):
        raise ValueError(f"text.format.schema must be a JSON schema object, got {shorten(fmt.get('schema'))}")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def chat_request(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request that runs `req` after the stored conversation `history` (chat messages, no instructions),
    and the conversation so far without the instructions (what a later turn builds on)."""
    req.check_fields()
    conversation = history + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    chat = ChatCompletionRequest(
        model=req.model,
        messages=system + conversation,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        response_format=response_format(req.text),
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        mm_processor_kwargs=req.mm_processor_kwargs,
        media_io_kwargs=req.media_io_kwargs,
    )
    return chat, conversation


def history_messages(request_messages: list[dict], output: list[OutputItem]) -> list[dict]:
    """The conversation to store for a later turn: this turn's messages (without the instructions' system
    message) and the output as an assistant message (text and tool calls; reasoning left out)."""
    text = "".join(p.text for item in output if isinstance(item, MessageItem) for p in item.content)
    calls = [
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        for item in output
        if isinstance(item, FunctionCallItem)
    ]
    reply: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        reply["tool_calls"] = calls
    return [*request_messages, reply]
