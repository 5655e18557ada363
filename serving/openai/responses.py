"""OpenAI-shaped error responses and the server-sent-events response."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from kiln.serving.openai.protocol import ErrorBody, ErrorResponse

# OpenAI's error types by status
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               429: "requests", 500: "server_error", 503: "server_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorBody(message=message, type=ERROR_TYPES.get(status, "server_error"),
                                         param=param, code=code))


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code).model_dump(), status_code=status, headers=headers)


def sse_event(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(status: int, message: str, code: str | None = None) -> str:
    """A failure after the 200 headers went out: an error event (the stream then ends with [DONE]) with the body
    the same failure gets before the headers (``type`` from ``status``; ``code`` a string or null, as OpenAI's)."""
    return sse_event(json.dumps(error_body(status, message, code=code).model_dump()))


class SSEResponse(StreamingResponse):
    """text/event-stream whose ``on_close`` runs however the response ends (finished, failed, or cancelled
    by a disconnect before the body iterator even started), so runtime requests are never left behind."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
