"""OpenAI's batch file format (engine-free): every kind of bad line becomes an error naming the line, and
duplicates of a custom_id are refused so that each custom_id is answered once."""

from __future__ import annotations

import json

from kiln.serving.batch.lines import BatchLine, LineError, error_line, is_error, parse_lines, response_line


def line(custom_id="a", url="/v1/completions", body=None, **extra) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": body if body is not None else {"prompt": "x"}, **extra}).encode()


def test_parse_lines_good_and_bad():
    data = b"\n".join([
        line("a"), b"", line("b", "/v1/chat/completions", {"messages": []}), b"{not json", b"[1, 2]",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}).encode(),
        line("c", "/v1/embeddings"), line("d", body=[1]), line("a"), line("e", extra_field=1),
        json.dumps({"custom_id": "f", "method": "GET", "url": "/v1/completions", "body": {}}).encode(), b"   ",
    ])
    items = parse_lines(data)
    assert [it.line_no for it in items] == [1, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert items[0] == BatchLine(1, "a", "/v1/completions", {"prompt": "x"})
    assert items[1] == BatchLine(3, "b", "/v1/chat/completions", {"messages": []})
    errors = {it.line_no: it for it in items if isinstance(it, LineError)}
    assert errors[4].code == "invalid_json" and errors[4].custom_id is None and "line 4" in errors[4].message
    assert errors[5].code == "invalid_request" and "JSON object" in errors[5].message
    assert errors[6].code == "missing_required_parameter" and "custom_id" in errors[6].message
    assert errors[7].code == "invalid_url" and "/v1/embeddings" in errors[7].message and errors[7].custom_id == "c"
    assert errors[8].code == "invalid_request" and "body" in errors[8].message
    assert errors[9].code == "duplicate_custom_id" and "'a'" in errors[9].message
    assert "extra_field" in errors[10].message and "'GET'" in errors[11].message


def test_output_records():
    ok = response_line("a", 200, {"id": "cmpl-1", "choices": []})
    assert ok["custom_id"] == "a" and ok["error"] is None and ok["id"].startswith("batch_req_")
    assert ok["response"] == {"status_code": 200, "request_id": "cmpl-1", "body": {"id": "cmpl-1", "choices": []}}
    assert not is_error(ok)
    assert is_error(response_line("a", 400, {"error": {"message": "m"}}))
    err = error_line(LineError(4, None, "invalid_json", "line 4 is not valid JSON"))
    assert err["response"] is None and err["error"] == {"code": "invalid_json", "message": "line 4 is not valid JSON",
                                                        "line": 4}
    assert is_error(err)
