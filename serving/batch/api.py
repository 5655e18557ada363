"""``/v1/files`` and ``/v1/batches`` on the OpenAI server (``kiln serve --batch-store DIR``): OpenAI's
objects, as the official client's ``files`` and ``batches`` resources read them. The app's middleware
already checks the API key and the drain gate on every /v1 path."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.serving.batch.dispatch import Dispatcher
from kiln.serving.batch.feeder import Feeder
from kiln.serving.batch.lines import URLS
from kiln.serving.batch.store import BatchStore
from kiln.serving.batch.worker import BatchWorker
from kiln.serving.openai.generation import ServingState
from kiln.serving.openai.protocol import FieldError
from kiln.serving.openai.responses import error_response

MAX_FILE_BYTES = 200 << 20   # OpenAI's bound on a batch input file
WINDOWS = ("24h",)


def _not_found(kind: str, oid: str) -> JSONResponse:
    return error_response(404, f"no {kind} with id {oid!r} in this server's batch store", param="id")


def add_batch_api(app: FastAPI, llm, store: BatchStore, *, window: int, model_name: str, fingerprint: str,
                  chat_template, tool_call_parser: str | None) -> BatchWorker:
    """Add the routes; the worker they feed (the caller starts it on the server's loop and stops it on drain).
    ``window``: batch lines in the engine at once (batch work gets its own admission count, so it never takes
    the online ``--max-waiting`` slots)."""
    workers = app.state.serving.workers   # the online server's prompt workers (it shuts them down)
    dispatcher = Dispatcher(ServingState(llm, max_waiting=window, workers=workers), model_name=model_name,
                            fingerprint=fingerprint, chat_template=chat_template, tool_call_parser=tool_call_parser)
    worker = BatchWorker(store, Feeder(dispatcher, window))

    @app.post("/v1/files")
    async def upload_file(request: Request) -> JSONResponse:
        form = await request.form(max_files=1, max_fields=4, max_part_size=MAX_FILE_BYTES)
        try:
            file, purpose = form.get("file"), form.get("purpose")
            if not isinstance(file, UploadFile):
                raise FieldError("file", "send the file as the multipart field 'file'")
            if purpose != "batch":
                raise FieldError("purpose", f"purpose must be 'batch' (the only kind this server takes), "
                                            f"got {purpose!r}")
            data = await file.read(MAX_FILE_BYTES + 1)
            if len(data) > MAX_FILE_BYTES:
                raise FieldError("file", f"the file is larger than {MAX_FILE_BYTES >> 20} MiB; split it")
            return JSONResponse(store.add_file(data, file.filename or "upload.jsonl", purpose))
        finally:
            await form.close()

    @app.get("/v1/files")
    async def list_files() -> JSONResponse:
        return JSONResponse({"object": "list", "data": store.files(), "has_more": False})

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> JSONResponse:
        f = store.file(file_id)
        return JSONResponse(f) if f is not None else _not_found("file", file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        data = store.file_content(file_id)
        return Response(data, media_type="application/octet-stream") if data is not None \
            else _not_found("file", file_id)

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            raise FieldError(None, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise FieldError(None, "the request body must be a JSON object")
        unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
        if unknown:
            raise FieldError(unknown[0], f"{unknown[0]} is not a field of this endpoint")
        fid, endpoint = body.get("input_file_id"), body.get("endpoint")
        window_name, metadata = body.get("completion_window"), body.get("metadata")
        if not isinstance(fid, str) or (f := store.file(fid)) is None:
            return error_response(404 if isinstance(fid, str) else 400, f"no file with id {fid!r}: upload the "
                                  "input with POST /v1/files (purpose 'batch') first", param="input_file_id")
        if f["purpose"] != "batch":
            raise FieldError("input_file_id", f"file {fid!r} has purpose {f['purpose']!r}, not 'batch'")
        if endpoint not in URLS:
            raise FieldError("endpoint", f"endpoint must be one of {list(URLS)}, got {endpoint!r}")
        if window_name not in WINDOWS:
            raise FieldError("completion_window", f"completion_window must be one of {list(WINDOWS)}, got "
                                                  f"{window_name!r}")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise FieldError("metadata", "metadata must be an object of at most 16 string values")
        batch = store.add_batch(fid, endpoint, window_name, metadata)
        worker.wake()
        return JSONResponse(batch)

    @app.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None) -> JSONResponse:
        if not 1 <= limit <= 100:
            raise FieldError("limit", f"limit must be between 1 and 100, got {limit}")
        data, more = store.batches(limit, after)
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": more})

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str) -> JSONResponse:
        b = store.batch(batch_id)
        return JSONResponse(b) if b is not None else _not_found("batch", batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> JSONResponse:
        if store.batch(batch_id) is None:
            return _not_found("batch", batch_id)
        store.cancel(batch_id)
        worker.cancel(batch_id)
        return JSONResponse(store.batch(batch_id))

    return worker
