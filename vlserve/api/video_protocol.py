"""The messages of the live video routes (vlserve.api.video_sessions): the REST body that opens a session, the JSON
messages a WebSocket client sends, the frames it sends (decoded here), and the error messages it gets back.

Every body and message is strict: an unknown field is refused by name, never ignored.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vlserve.api.errors import APIError, error_body
from vlserve.api.protocol import ChatMessage, check_unicode
from vlserve.engine.generation_config import GenerationDefaults
from vlserve.sampling_params import SamplingParams
from vlserve.shorten import shorten


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class VideoSessionRequest(_Strict):
    """POST /v1/video/sessions."""

    model: str | None = None
    messages: list[ChatMessage] | None = None  # earlier text turns, before the one holding the video
    fps: float = Field(2.0, gt=0)
    max_frames: int | None = Field(None, ge=1)
    max_seconds: float | None = Field(None, gt=0)
    window_slack: int = Field(0, ge=0)
    mm_processor_kwargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class FramesAppend(_Strict):
    """`{"type": "frames.append", "frames": ["data:image/...;base64,...", ...]}`."""

    type: Literal["frames.append"]
    frames: list[str] = Field(min_length=1)


class Question(_Strict):
    """`{"type": "question", "question": ..., sampling fields}`: answered over the frames appended before it."""

    type: Literal["question"]
    question_id: str | None = None
    question: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None

    def sampling_params(self, defaults: GenerationDefaults) -> SamplingParams:
        """SamplingParams (ValueError for a bad value); the server's generation defaults fill the unset fields."""
        check_unicode(self.question)
        check_unicode(self.stop)
        given = {k for k in self.model_fields_set if getattr(self, k) is not None}
        params = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            max_tokens=self.max_tokens,
            stop=self.stop,
        )
        return defaults.apply(params, given)


class SessionClose(_Strict):
    """`{"type": "session.close"}`: close the session and the connection."""

    type: Literal["session.close"]


ClientMessage = FramesAppend | Question | SessionClose
_MESSAGES = {"frames.append": FramesAppend, "question": Question, "session.close": SessionClose}


def parse_message(text: str) -> ClientMessage:
    """A client's JSON text message (APIError 400 naming the field for bad JSON, an unknown type, a bad field)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(f"invalid JSON message: {e}", 400) from None
    if not isinstance(data, dict):
        raise APIError("a message must be a JSON object with a 'type'", 400, "type")
    model = _MESSAGES.get(data.get("type"))
    if model is None:
        raise APIError(
            f"unknown message type {shorten(data.get('type'))}; expected one of {', '.join(_MESSAGES)}", 400, "type"
        )
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    """The first problem of a pydantic error as a 400 naming its field."""
    first = e.errors()[0]
    param = ".".join(str(x) for x in first.get("loc", ())) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        message = "unknown field (no field is ignored)"
    return APIError(f"{param}: {message}" if param else message, 400, param)


def error_message(err: APIError, question_id: str | None = None) -> dict:
    """The `{"type": "error", "error": {...}}` message (with the question's id when it is one's)."""
    out = {"type": "error", **error_body(err.message, err.status, err.param)}
    if question_id is not None:
        out["question_id"] = question_id
    return out


def question_id_of(text: str) -> str | None:
    """The `question_id` of a message that failed its checks, when it has a string one (for the error)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    qid = data.get("question_id") if isinstance(data, dict) and data.get("type") == "question" else None
    return qid if isinstance(qid, str) else None


def data_url_bytes(url: str, index: int) -> bytes:
    """The bytes of a `data:image/...;base64,` URL (APIError 400 for anything else)."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise APIError(
            f"frames[{index}] must be a data:image/...;base64, URL (send raw bytes as a binary message)",
            400,
            f"frames.{index}",
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"frames[{index}] is not valid base64", 400, f"frames.{index}") from None


def decode_frame(data: bytes, max_pixels: int | None, what: str = "frame") -> np.ndarray:
    """Encoded image bytes (JPEG / PNG / WebP / any Pillow reads) -> [H, W, 3] uint8 (ValueError when not an
    image, or bigger than `max_pixels`, checked before decoding the pixels)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        if max_pixels is not None and image.width * image.height > max_pixels:
            raise ValueError(f"{what} of {image.width}x{image.height} exceeds the {max_pixels}-pixel limit")
        return np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError) as e:
        raise ValueError(f"{what} is not a decodable image: {e}") from None
