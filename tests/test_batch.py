"""Batch work end to end: ``kiln run-batch`` on a 200-line file, and the Batch API of a real ``kiln serve``
subprocess through the official ``openai`` client (files + batches), including a SIGKILL mid-batch and a
restart on the same store: every custom_id answered exactly once, greedy outputs equal to ``LLM.generate``
on the same engine, and the server's bodies equal to run-batch's."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from kiln.runtime import LLM, SamplingParams

from runtime_support import get_engine
from test_serving_openai import API_KEY, CHATML, MODEL, chat_ids, start_server

pytestmark = pytest.mark.xdist_group("serving")   # the engine of test_serving_openai, built once per worker

NUM_LINES = 200
BAD = {"bad-body": {"prompt": "x", "temperature": "hot"}, "too-long": {"prompt": [5, 6], "max_tokens": 1000}}


def request_line(custom_id: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def good_bodies() -> dict[str, dict]:
    rng = random.Random(7)
    return {f"req-{i}": {"model": MODEL, "prompt": [rng.randrange(3, 500) for _ in range(rng.randint(2, 12))],
                         "max_tokens": rng.randint(4, 12), "temperature": 0}
            for i in range(NUM_LINES - 1 - len(BAD))}


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory) -> Path:
    lines = [request_line(cid, body) for cid, body in good_bodies().items()]
    lines.insert(17, "{this is not json")
    lines.insert(40, request_line("bad-body", BAD["bad-body"]))
    lines.insert(90, request_line("too-long", BAD["too-long"]))
    path = tmp_path_factory.mktemp("batch") / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert len(lines) == NUM_LINES
    return path


@pytest.fixture(scope="module")
def ckpt(checkpoint_dir):
    return checkpoint_dir("llama")


@pytest.fixture(scope="module")
def engine(ckpt):
    return get_engine(ckpt)


@pytest.fixture(scope="module")
def ref(engine):
    with LLM(engine) as llm:
        yield llm


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tpl") / "chatml.jinja"
    path.write_text(CHATML)
    return path


def run_batch(engine, inp: Path, out: Path, *args: str):
    from kiln.runtime.cli import main

    r = CliRunner().invoke(main, ["run-batch", "-i", str(inp), "-o", str(out), "--model", str(engine.directory),
                                  "--no-progress", *args])
    assert r.exit_code == 0, r.output + repr(r.exception)
    return r


def records(data: str | bytes) -> list[dict]:
    return [json.loads(x) for x in (data.decode() if isinstance(data, bytes) else data).splitlines() if x.strip()]


def by_custom_id(recs: list[dict]) -> dict[str, dict]:
    ids = [r["custom_id"] for r in recs if r["custom_id"] is not None]
    assert len(ids) == len(set(ids)), "a custom_id was answered twice"
    return {r["custom_id"]: r for r in recs if r["custom_id"] is not None}


def check_answers(recs: list[dict], ref: LLM) -> None:
    """One record per input line; greedy texts equal LLM.generate's; the bad lines' errors name the problem."""
    assert len(recs) == NUM_LINES
    got = by_custom_id(recs)
    bodies = good_bodies()
    assert set(got) == set(bodies) | set(BAD)
    wants = ref.generate([b["prompt"] for b in bodies.values()],
                         [SamplingParams(temperature=0, max_tokens=b["max_tokens"]) for b in bodies.values()])
    for cid, want in zip(bodies, wants):
        r = got[cid]["response"]
        assert r["status_code"] == 200 and got[cid]["error"] is None
        assert r["body"]["choices"][0]["text"] == want.text, cid
        assert r["body"]["usage"]["completion_tokens"] == len(want.token_ids)
        assert r["request_id"] == r["body"]["id"] and r["body"]["model"] == MODEL
    bad = got["bad-body"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature"
    long = got["too-long"]["response"]
    assert long["status_code"] == 400 and "max_seq_len" in long["body"]["error"]["message"]
    unparsable = [r for r in recs if r["custom_id"] is None]
    assert len(unparsable) == 1 and unparsable[0]["error"]["code"] == "invalid_json"
    assert unparsable[0]["error"]["line"] == 18 and unparsable[0]["response"] is None


@pytest.fixture(scope="module")
def run_batch_output(engine, batch_file, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("batch-out") / "out.jsonl"
    run_batch(engine, batch_file, out, "--served-model-name", MODEL)
    return records(out.read_text())


def test_run_batch_answers_every_line(run_batch_output, ref):
    check_answers(run_batch_output, ref)


def test_run_batch_resumes(engine, batch_file, run_batch_output, tmp_path, ref):
    """An interrupted run (50 lines written, the 51st cut off) resumes: the rest, each line once."""
    out = tmp_path / "out.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in run_batch_output[:50])
    out.write_text(text + json.dumps(run_batch_output[50])[:30])
    r = run_batch(engine, batch_file, out)
    assert "150 lines answered" in r.output and "(50 answered by an earlier run)" in r.output
    recs = records(out.read_text())
    assert recs[:50] == run_batch_output[:50]
    check_answers(recs, ref)
    r = run_batch(engine, batch_file, out)   # nothing left
    assert "0 lines answered" in r.output and len(records(out.read_text())) == NUM_LINES


def test_run_batch_chat_and_errors(engine, ckpt, template, tmp_path, ref):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Fire the kiln"}]
    inp = tmp_path / "chat.jsonl"
    inp.write_text("\n".join([
        request_line("chat", {"model": "any", "messages": messages, "max_tokens": 6, "temperature": 0},
                     "/v1/chat/completions"),
        request_line("stream", {"prompt": "x", "stream": True}),
        request_line("embed", {"input": "x"}, "/v1/embeddings"),
        request_line("chat", {"prompt": "again"}),
    ]))
    out = tmp_path / "out.jsonl"
    run_batch(engine, inp, out, "--chat-template", str(template))
    recs = records(out.read_text())
    assert len(recs) == 4
    ok = next(r for r in recs if r["custom_id"] == "chat" and r["response"])["response"]
    ids = chat_ids(AutoTokenizer.from_pretrained(ckpt), messages, CHATML)
    want = ref.generate([ids], SamplingParams(temperature=0, max_tokens=6))[0]
    assert ok["status_code"] == 200 and ok["body"]["choices"][0]["message"]["content"] == want.text
    assert ok["body"]["model"] == "any" and ok["body"]["object"] == "chat.completion"
    errors = {r["error"]["code"] for r in recs if r["error"]}
    assert errors == {"invalid_url", "duplicate_custom_id"}
    stream = next(r for r in recs if r["custom_id"] == "stream")["response"]
    assert stream["status_code"] == 400 and stream["body"]["error"]["param"] == "stream"


# ---- the Batch API of kiln serve ------------------------------------------------------------------------
def wait_batch(client: openai.OpenAI, bid: str, until, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(bid)
        if until(b):
            return b
        assert time.monotonic() < deadline, f"batch {bid} still {b.status} {b.request_counts}"
        time.sleep(0.05)


def content(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else records(client.files.content(file_id).read())


def test_batch_api_survives_sigkill(engine, batch_file, run_batch_output, template, tmp_path, ref):
    store = tmp_path / "store"
    # a small batch and window: the batch takes long enough to be killed in the middle
    args = ("--batch-store", str(store), "--chat-template", str(template), "--max-batch-size", "4",
            "--batch-window", "4")
    server = start_server(engine.directory, tmp_path / "first.log", *args)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        f = client.files.create(file=batch_file.open("rb"), purpose="batch")
        assert f.bytes == batch_file.stat().st_size and f.filename == "in.jsonl"
        assert client.files.retrieve(f.id).id == f.id
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                      metadata={"job": "eval"})
        assert batch.status == "validating" and batch.metadata == {"job": "eval"}
        mid = wait_batch(client, batch.id, lambda b: b.request_counts.completed >= 40)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        assert mid.status == "in_progress" and mid.request_counts.completed < NUM_LINES - 3, mid
    finally:
        server.stop()
    server = start_server(engine.directory, tmp_path / "second.log", *args)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        done = wait_batch(client, batch.id, lambda b: b.status not in ("validating", "in_progress", "finalizing"))
        assert done.status == "completed" and done.completed_at and done.in_progress_at
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (200, 197, 3)
        output, errors = content(client, done.output_file_id), content(client, done.error_file_id)
        assert len(output) == 197 and len(errors) == 3
        check_answers(output + errors, ref)
        # the same bodies as kiln run-batch (ids and timestamps aside)
        mine, theirs = by_custom_id(output), by_custom_id(run_batch_output)
        for cid, r in mine.items():
            a, b = r["response"]["body"], theirs[cid]["response"]["body"]
            assert (a["choices"], a["usage"]) == (b["choices"], b["usage"]), cid
        metrics = server.metrics()   # this server answered the lines the first one had not
        ended = metrics['kiln_class_requests_ended_total{request_class="batch"}']
        assert 0 < ended <= 197 - mid.request_counts.completed + 4   # + the window aborted by the kill
        assert metrics['kiln_class_generation_tokens_total{request_class="batch"}'] >= ended
        assert metrics['kiln_class_time_to_first_token_seconds_count{request_class="batch"}'] == ended
        assert metrics['kiln_class_requests_ended_total{request_class="online"}'] == 0
        check_cancel_list_and_errors(client, tmp_path, batch.id)
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log.read_text()[-3000:]


def check_cancel_list_and_errors(client: openai.OpenAI, tmp_path: Path, first_id: str) -> None:
    # cancel: a long batch cancelled while it runs ends "cancelled" with what it answered
    long = tmp_path / "long.jsonl"
    long.write_text("\n".join(request_line(f"l{i}", {"prompt": [7, 8, 9, i % 400 + 3], "max_tokens": 100,
                                                        "ignore_eos": True}) for i in range(200)))
    f = client.files.create(file=long.open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_batch(client, b.id, lambda x: x.status == "in_progress")
    cancelled = client.batches.cancel(b.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    cancelled = wait_batch(client, b.id, lambda x: x.status == "cancelled")
    answered = content(client, cancelled.output_file_id)
    assert len(answered) == cancelled.request_counts.completed < 200 and cancelled.cancelled_at
    assert all(len(r["response"]["body"]["choices"][0]["text"]) > 0 for r in answered)
    # a chat batch whose file mixes in another endpoint's line: that line is a line error
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join([
        request_line("c1", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                     "/v1/chat/completions"),
        request_line("c2", {"prompt": "x"}),
        request_line("c3", {"model": "other", "messages": [{"role": "user", "content": "hi"}]},
                     "/v1/chat/completions")]))
    f = client.files.create(file=mixed.open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = wait_batch(client, b.id, lambda x: x.status == "completed")
    out, err = content(client, b.output_file_id), content(client, b.error_file_id)
    assert [r["custom_id"] for r in out] == ["c1"] and out[0]["response"]["body"]["object"] == "chat.completion"
    assert {r["custom_id"]: (r["error"] or {}).get("code") or r["response"]["status_code"] for r in err} == \
        {"c2": "invalid_url", "c3": 404}
    # list: newest first, paged with after
    page = client.batches.list(limit=2)
    assert [x.id for x in page.data] == [b.id, cancelled.id] and page.has_more
    assert [x.id for x in client.batches.list(limit=2, after=cancelled.id).data] == [first_id]
    assert first_id in [x.id for x in client.batches.list()]   # the client follows every page
    # requests the API refuses
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch-nope")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=mixed.open("rb"), purpose="fine-tune")
