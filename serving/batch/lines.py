"""OpenAI's batch file format: parsing input lines, writing output and error lines.

Input line: ``{"custom_id": str, "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body": {...}}``. Output line: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``: a request the endpoint answered (2xx or not) has ``response``; a line that never reached an
endpoint (not JSON, no custom_id, unknown url, duplicate custom_id) has ``error`` ({"code", "message"}) and
``response`` null. An answer with status >= 400 or with ``error`` set belongs in the error file.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

URLS = ("/v1/completions", "/v1/chat/completions")
MAX_LINE_BYTES = 16 << 20   # as the HTTP server's body bound


@dataclass(frozen=True)
class BatchLine:
    """One valid input line: what the endpoint at ``url`` is asked."""

    line_no: int
    custom_id: str
    url: str
    body: dict


@dataclass(frozen=True)
class LineError:
    """An input line that cannot be sent to any endpoint (``custom_id`` when the line had one)."""

    line_no: int
    custom_id: str | None
    code: str
    message: str


def parse_line(line_no: int, text: str | bytes) -> BatchLine | LineError:
    """The line, or why it is not one (``line_no`` counts from 1, as editors do)."""
    where = f"line {line_no}"
    if len(text) > MAX_LINE_BYTES:
        return LineError(line_no, None, "invalid_request", f"{where} is larger than {MAX_LINE_BYTES >> 20} MiB")
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return LineError(line_no, None, "invalid_json", f"{where} is not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return LineError(line_no, None, "invalid_request", f"{where} must be a JSON object, got {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(line_no, None, "missing_required_parameter",
                         f"{where} has no custom_id (a non-empty string that names the request in the output)")

    def bad(code: str, message: str) -> LineError:
        return LineError(line_no, custom_id, code, f"{where} (custom_id {custom_id!r}): {message}")

    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return bad("invalid_request", f"unknown fields {unknown}; a line has custom_id, method, url and body")
    if obj.get("method") != "POST":
        return bad("invalid_request", f"method must be 'POST', got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in URLS:
        return bad("invalid_url", f"url must be one of {list(URLS)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("invalid_request", f"body must be a JSON object (the endpoint's request), got {type(body).__name__}")
    return BatchLine(line_no, custom_id, url, body)


def parse_lines(data: bytes) -> list[BatchLine | LineError]:
    """Every non-blank line of a file, duplicates of an earlier custom_id as errors (each is answered once)."""
    out: list[BatchLine | LineError] = []
    seen: set[str] = set()
    for i, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        item = parse_line(i, raw)
        if isinstance(item, BatchLine):
            if item.custom_id in seen:
                item = LineError(i, item.custom_id, "duplicate_custom_id",
                                 f"line {i}: custom_id {item.custom_id!r} was used by an earlier line; each line "
                                 "needs its own")
            seen.add(item.custom_id)
        out.append(item)
    return out


def new_request_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def response_line(custom_id: str, status_code: int, body: dict, request_id: str | None = None) -> dict:
    rid = request_id or body.get("id") or new_request_id()
    return {"id": new_request_id(), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": rid, "body": body}, "error": None}


def error_line(err: LineError) -> dict:
    return {"id": new_request_id(), "custom_id": err.custom_id, "response": None,
            "error": {"code": err.code, "message": err.message, "line": err.line_no}}


def is_error(record: dict) -> bool:
    return record["error"] is not None or record["response"]["status_code"] >= 400
