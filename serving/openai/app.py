"""The FastAPI application: routes, request parsing with OpenAI-shaped errors, API key, drain gate, metrics.

Bodies are read and validated here (``Model.model_validate_json``), not by FastAPI's parameter binding, so
that every malformed request (bad JSON included) gets OpenAI's error object with ``param`` naming the field.
A body over ``MAX_REQUEST_BYTES`` gets 413 (by its Content-Length, before it is read, when it declares one); a
large one is parsed in the prompt workers, off the event loop. There is no /docs page (FastAPI's loads Swagger
UI from a CDN): the API is OpenAI's.

LoRA adapters (an engine built with lora_target_modules): ``/v1/models`` lists each loaded adapter with the
served model as its ``parent``; a request's ``model`` may name one (its tokens come from that adapter). With
``enable_lora_runtime_loading``, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's bodies)
load and unload adapters while serving; without it they answer 404.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from importlib import metadata

import pydantic_core
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.contract import AdapterLoadError, ConfigError, InvalidRequestError
from kiln.serving.chat_template import ChatTemplate
from kiln.serving.json_values import count_json_values
from kiln.serving.metrics import RuntimeCollector
from kiln.serving.openai.chat import check_raw_chat, create_chat_completion
from kiln.serving.openai.completions import check_raw_completion, create_completion
from kiln.serving.openai.generation import ClientGone, Overloaded, RuntimeRefused, ServingState, ShuttingDown
from kiln.serving.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoraAdapterRequest,
)
from kiln.serving.openai.responses import error_response
from kiln.serving.openai.tool_parsers import detect_parser
from kiln.serving.prompt_bounds import MAX_REQUEST_BYTES
from kiln.serving.prompt_workers import Busy, PromptWorkers

logger = logging.getLogger("kiln.serving")
ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
          "/health", "/metrics", "/version")


def kiln_version() -> str:
    try:
        return metadata.version("kiln-llm")
    except metadata.PackageNotFoundError:
        return "unknown"


def _loc(loc: tuple) -> str | None:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_validation_error(exc: ValidationError) -> tuple[str | None, str]:
    """(param, message) of the first problem, in OpenAI's terms."""
    errors = exc.errors(include_url=False)
    e = errors[0]
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    if e["type"] == "json_invalid":
        return None, f"the request body is not valid JSON: {e['msg'].removeprefix('Invalid JSON: ')}"
    param = _loc(e["loc"])
    if param is None:
        return None, f"the request body must be a JSON object, got {_short(e.get('input'))}"
    if e["type"] == "missing":
        return param, f"{param} is required{more}"
    if e["type"] == "extra_forbidden":
        return param, f"{param} is not a field of this endpoint (or kiln does not support it){more}"
    msg = e["msg"].removeprefix("Value error, ")
    return param, f"{param}: {msg}, got {_short(e.get('input'))}{more}"


class TooLarge(Exception):
    """The request body is over MAX_REQUEST_BYTES (413)."""


TOO_LARGE = f"the request body is larger than {MAX_REQUEST_BYTES >> 20} MiB; send a smaller one"
PRECHECK_BYTES = 64 << 10


def parse_body(model: type[BaseModel], data: bytes, precheck: Callable[[dict], None] | None = None,
               max_values: int | None = None):
    """The validated body (FieldError naming the problem); the long part of reading a large request. A large body
    is first refused if it holds more than ``max_values`` JSON values (counted without parsing, letting other
    threads run: parsing millions of them holds the GIL for a third of a second), then parsed without validation
    (quick) for ``precheck`` to refuse what no engine bound allows (a prompt of millions of ids) before each of its
    elements is validated."""
    if max_values is not None and len(data) >= PRECHECK_BYTES:
        values = count_json_values(data)
        if values > max_values:
            raise FieldError(None, f"the request body holds {values} JSON values (elements of arrays and objects), "
                                   f"more than any request this server can take has ({max_values}); send fewer")
    if precheck is not None and len(data) >= PRECHECK_BYTES:
        try:
            raw = pydantic_core.from_json(data)
        except ValueError:
            raw = None   # malformed: the validation below says where
        if isinstance(raw, dict):
            precheck(raw)
        del raw
    try:
        body = model.model_validate_json(data)
    except ValidationError as exc:
        raise FieldError(*describe_validation_error(exc)) from None
    body.check_combinations()
    return body


async def read_body(request: Request, model: type[BaseModel], workers: PromptWorkers,
                    precheck: Callable[[dict], None] | None = None, max_values: int | None = None):
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise TooLarge(TOO_LARGE)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_REQUEST_BYTES:
                raise TooLarge(TOO_LARGE)
            chunks.append(chunk)
    except ClientDisconnect:   # the client left, or the server closed it (its body read timeout)
        raise ClientGone() from None
    data = b"".join(chunks)
    del chunks
    return await workers.run(parse_body, model, data, precheck, max_values, size=len(data))


def bearer_token(scope: Scope) -> bytes | None:
    """The credentials of an ``Authorization: Bearer ...`` header (the scheme matched case-insensitively, as RFC
    7235 says), or None."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def engine_fingerprint(llm) -> str:
    """``system_fingerprint``: this kiln version + this engine (what decides the outputs)."""
    config = json.dumps(llm.engine.config.to_dict(), sort_keys=True, default=str)
    return "fp_kiln_" + hashlib.sha256((kiln_version() + config).encode()).hexdigest()[:12]


class ModelNotFound(Exception):
    """The request names a model this server does not serve (404)."""


class Gate:
    """Pure ASGI middleware (it must not buffer streams or hide disconnects): counts HTTP requests by endpoint
    and status, checks the API key on /v1 (and on /metrics with ``metrics_require_key``), and refuses /v1
    requests with 503 while the server drains."""

    def __init__(self, app: ASGIApp, state: ServingState, api_key: str | None, requests: Counter,
                 metrics_require_key: bool = False):
        self.app, self.state, self.api_key, self.requests = app, state, api_key, requests
        self.metrics_require_key = metrics_require_key

    def _authorized(self, scope: Scope) -> bool:
        token = bearer_token(scope)
        return token is not None and secrets.compare_digest(token, self.api_key.encode())

    def _needs_key(self, path: str) -> bool:
        return self.api_key is not None and (path.startswith("/v1/") or (self.metrics_require_key
                                                                          and path == "/metrics"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = [500]

        async def send_and_count(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self._needs_key(path) and not self._authorized(scope):
                await error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                     code="invalid_api_key")(scope, receive, send_and_count)
            elif path.startswith("/v1/") and not self.state.accepting:
                await error_response(503, "the server is shutting down; send the request to another replica",
                                     )(scope, receive, send_and_count)
            else:
                await self.app(scope, receive, send_and_count)
        finally:
            endpoint = path if path in ROUTES else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")
            self.requests.labels(endpoint=endpoint, status=str(status[0])).inc()


def create_app(llm, *, model_name: str, api_key: str | None = None, max_waiting: int = 256,
               chat_template: ChatTemplate | None = None, tool_call_parser: str | None = None,
               metrics_require_key: bool = False, prompt_workers: int = 1,
               enable_lora_runtime_loading: bool = False) -> FastAPI:
    """The OpenAI-compatible app over one ``LLM`` (which the caller starts and shuts down; ``app.state.serving``
    is shut down with it). ``tool_call_parser``: how ``tool_choice="auto"`` finds tool calls in answers (default:
    the one the chat template's format needs)."""
    if metrics_require_key and api_key is None:
        raise ValueError("metrics_require_key needs an api_key")
    state = ServingState(llm, max_waiting, PromptWorkers(prompt_workers))
    if tool_call_parser is None:
        tool_call_parser = detect_parser(chat_template.source if chat_template is not None else None)
    created = int(time.time())
    version = kiln_version()
    engine_config = llm.engine.config
    fingerprint = engine_fingerprint(llm)

    registry = CollectorRegistry()
    registry.register(RuntimeCollector(llm, server_rejected=lambda: state.rejected))
    http_requests = Counter("kiln_http_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"],
                            registry=registry)
    Gauge("kiln_server_requests_waiting", "Requests admitted by the HTTP server that have no output yet "
          "(what --max-waiting bounds).", registry=registry).set_function(state.num_waiting)

    app = FastAPI(title="kiln (OpenAI-compatible)", version=version, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.serving = state
    app.add_middleware(Gate, state=state, api_key=api_key, requests=http_requests,
                       metrics_require_key=metrics_require_key)

    @app.exception_handler(FieldError)
    async def _field_error(request: Request, exc: FieldError):
        if not isinstance(exc, RuntimeRefused):   # the runtime counts what it refuses
            state.rejected += 1
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(TooLarge)
    async def _too_large(request: Request, exc: TooLarge):
        state.rejected += 1
        return error_response(413, str(exc), headers={"Connection": "close"})

    @app.exception_handler(Overloaded)
    @app.exception_handler(Busy)
    async def _overloaded(request: Request, exc: Exception):
        state.rejected += 1
        return error_response(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": "1"})

    @app.exception_handler(ShuttingDown)
    async def _shutting_down(request: Request, exc: ShuttingDown):
        return error_response(503, str(exc))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)   # nginx's "client closed request"; nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unexpected error serving %s", request.url.path)
        return error_response(500, f"internal server error ({type(exc).__name__}); see the server log")

    def resolve_model(name: str | None) -> str | None:
        """The LoRA adapter a request's model names (None: the base model); ModelNotFound for any other name."""
        if name is None or name == model_name:
            return None
        if name in llm.lora_names():
            return name
        raise ModelNotFound(name)

    @app.exception_handler(ModelNotFound)
    async def _model_not_found(request: Request, exc: ModelNotFound):
        adapters = f" and the LoRA adapters {llm.lora_names()}" if llm.lora_names() else ""
        return error_response(404, f"the model {exc.args[0]!r} does not exist here; this server serves "
                                   f"{model_name!r}{adapters} (GET /v1/models)", param="model",
                              code="model_not_found")

    card = ModelCard(id=model_name, created=created, max_model_len=state.limits.max_seq_len)
    adapter_cards: dict[str, ModelCard] = {}

    def cards() -> list[ModelCard]:
        adapters = llm.executor.adapters
        out = [card]
        for adapter in adapters.adapters() if adapters is not None else []:
            known = adapter_cards.get(adapter.name)
            if known is None or known.root != adapter.path:
                known = adapter_cards[adapter.name] = ModelCard(id=adapter.name, created=int(time.time()),
                                                                max_model_len=card.max_model_len, root=adapter.path,
                                                                parent=model_name)
            out.append(known)
        return out

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(ModelList(data=cards()).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        for c in cards():
            if c.id == model_id:
                return JSONResponse(c.model_dump())
        raise ModelNotFound(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, state.workers, lambda raw: check_raw_completion(raw, state),
                               state.max_json_values)
        lora = resolve_model(body.model)
        return await create_completion(body, request, state, lora or model_name, fingerprint, lora)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, state.workers, lambda raw: check_raw_chat(raw, state),
                               state.max_json_values)
        lora = resolve_model(body.model)
        return await create_chat_completion(body, request, state, lora or model_name, fingerprint, chat_template,
                                            tool_call_parser, lora)

    if enable_lora_runtime_loading:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            body = await read_body(request, LoadLoraAdapterRequest, state.workers)
            if body.lora_name == model_name:
                raise FieldError("lora_name", f"{body.lora_name!r} is the served model's name; pick another")
            try:   # reading and converting take a while: off the event loop
                await asyncio.to_thread(llm.load_lora, body.lora_name, body.lora_path)
            except (AdapterLoadError, ConfigError) as exc:
                raise FieldError("lora_path" if isinstance(exc, AdapterLoadError) and "already loaded" not in str(exc)
                                 else "lora_name", str(exc)) from None
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            body = await read_body(request, UnloadLoraAdapterRequest, state.workers)
            try:
                llm.unload_lora(body.lora_name)
            except (InvalidRequestError, ConfigError) as exc:
                raise FieldError("lora_name", str(exc)) from None
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health")
    async def health() -> JSONResponse:
        failure = llm.executor.failure
        pool = llm.executor.health() if hasattr(llm.executor, "health") else {}   # disaggregated workers
        if failure is not None:
            return JSONResponse({"status": "failed", "detail": failure, **pool}, status_code=503)
        if not state.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok", **pool})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version_info() -> JSONResponse:
        c = engine_config
        return JSONResponse({"version": version, "engine": {
            "format_version": c.format_version, "backend": c.backend, "dtype": c.dtype,
            "quantization": c.quantization, "architecture": c.model.architecture, "kiln_version": c.kiln_version,
            "torch_version": c.torch_version}})

    return app
