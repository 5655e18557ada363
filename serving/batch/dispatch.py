"""One batch line -> the endpoint's own handler -> (status, body): the code path of ``POST /v1/completions``
and ``POST /v1/chat/completions`` (validation, chat template, structured output, tools), not a copy of it.

The handlers take a starlette ``Request`` only to notice a client leaving; a batch line's "client" never
leaves (cancelling a batch aborts its streams instead), so it gets a request whose receive channel never
reports a disconnect. Errors map to OpenAI's error bodies as the app's exception handlers map them.
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse

from kiln.runtime.outputs import BATCH_PRIORITY
from kiln.serving.chat_template import ChatTemplate
from kiln.serving.openai.app import TooLarge, parse_body
from kiln.serving.openai.chat import create_chat_completion
from kiln.serving.openai.completions import create_completion
from kiln.serving.openai.generation import Overloaded, ServingState, ShuttingDown
from kiln.serving.openai.protocol import ChatCompletionRequest, CompletionRequest, FieldError
from kiln.serving.openai.responses import error_response
from kiln.serving.prompt_workers import Busy

logger = logging.getLogger("kiln.serving")


class Unanswered(Exception):
    """The line was not answered (the server is stopping, or its batch was cancelled): it runs again later."""


async def _never_disconnects() -> dict:
    await asyncio.Event().wait()   # pending until cancelled together with the handler's watcher
    return {"type": "http.disconnect"}


def _batch_request(url: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": url, "headers": [], "query_string": b""},
                   _never_disconnects)


def _json(response: JSONResponse) -> tuple[int, dict]:
    return response.status_code, json.loads(response.body)


class Dispatcher:
    """Answers batch lines on one ``ServingState`` (its ``max_waiting`` bounds what batch work keeps waiting)."""

    def __init__(self, state: ServingState, *, model_name: str | None, fingerprint: str,
                 chat_template: ChatTemplate | None, tool_call_parser: str | None):
        """``model_name``: bodies naming another model get 404 (None: any name is served, and echoed)."""
        self.state, self.model_name, self.fingerprint = state, model_name, fingerprint
        self.chat_template, self.tool_call_parser = chat_template, tool_call_parser

    async def answer(self, url: str, body: dict) -> tuple[int, dict]:
        """(status code, response body) as the endpoint at ``url`` answers ``body``; Unanswered if the line must
        run again (the runtime aborted it at shutdown or cancel)."""
        try:
            return await self._answer(url, body)
        except FieldError as exc:
            return _json(error_response(400, str(exc), param=exc.param))
        except TooLarge as exc:
            return _json(error_response(413, str(exc)))
        except (Overloaded, Busy) as exc:   # the window is bounded by max_waiting; the prompt workers may be busy
            raise Unanswered(str(exc)) from None
        except ShuttingDown as exc:
            raise Unanswered(str(exc)) from None
        except Exception as exc:
            logger.exception("unexpected error answering a batch line for %s", url)
            return _json(error_response(500, f"internal server error ({type(exc).__name__}); see the server log"))

    async def _answer(self, url: str, body: dict) -> tuple[int, dict]:
        model = CompletionRequest if url == "/v1/completions" else ChatCompletionRequest
        request = parse_body(model, json.dumps(body).encode())   # JSON mode: the endpoint's strictness
        if request.stream:
            raise FieldError("stream", "batch requests cannot stream; leave stream out (or false)")
        if self.model_name is not None and request.model is not None and request.model != self.model_name:
            return _json(error_response(404, f"the model {request.model!r} does not exist here; this server serves "
                                             f"{self.model_name!r}", param="model", code="model_not_found"))
        request.priority = BATCH_PRIORITY   # below any an HTTP request may ask for: online work goes first
        served = self.model_name or request.model or "kiln"
        http = _batch_request(url)
        if url == "/v1/completions":
            response = await create_completion(request, http, self.state, served, self.fingerprint)
        else:
            response = await create_chat_completion(request, http, self.state, served, self.fingerprint,
                                                    self.chat_template, self.tool_call_parser)
        status, out = _json(response)
        if status == 503:   # aborted by a shutdown or a cancel: not an answer
            raise Unanswered(out["error"]["message"])
        return status, out
