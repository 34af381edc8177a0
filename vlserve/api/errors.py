"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the handlers that produce them.

400 bad JSON / fields / media / prompts, 401 API key, 404 unknown model or route, 503 waiting queue full. Anything
unexpected is a 500 with the same shape; no request can take the server down.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlserve.core.admission import QueueFullError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error with an HTTP status, turned into the OpenAI error body by the app's handler."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """The OpenAI error object for `status`."""
    kind = _TYPES.get(status)
    if kind is None:
        try:
            kind = HTTPStatus(status).phrase.replace(" ", "") + "Error"
        except ValueError:
            kind = "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def sse_error(message: str, status: int) -> str:
    """An error event for a stream whose headers were already sent."""
    return f"data: {json.dumps(error_body(message, status))}\n\n"


def to_api_error(exc: BaseException) -> APIError:
    """Map engine/processing exceptions to statuses: QueueFullError -> 503, ValueError -> 400, else 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(f"{exc}; retry later", 503)
    if isinstance(exc, (ValueError, TypeError, KeyError, IndexError, UnicodeError)):
        return APIError(str(exc) or type(exc).__name__, 400)
    logger.exception("internal error", exc_info=exc)
    return APIError(f"internal server error: {type(exc).__name__}: {exc}", 500)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = ".".join(loc) or None
    msgs = "; ".join(
        f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}" for e in errors[:5]
    )
    return msgs, param


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = _describe_validation(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError):
        err = to_api_error(exc)
        return error_response(err.message, err.status)

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception):
        err = to_api_error(exc)
        return error_response(err.message, err.status)
