"""Hostile clients against both frontends (issue 22), as real server subprocesses over loopback, every wait bounded:
prompts too large for the engine refused by their size before anything is tokenized (the server answering
/health meanwhile and giving its memory back), request bodies over the cap, slow and silent connections cut off
with a 408, the connection limit, choices counted against --max-waiting and the batch, the rejected-requests
counter, case-insensitive Bearer, no /docs, /metrics behind the key on request; then Triton: its request-size cap,
unknown fields and parameters refused by name, INT64 extremes (and JSON integers beyond INT32, unwrapped with
--int64-inputs), and which bad JSON tritonserver itself answers 500.
``scripts/bench_hostile.py`` measures the same attacks (latency, RSS) at the issue's sizes."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from kiln.runtime import SamplingParams
from kiln.runtime.cli import main
from kiln.serving.openai.app import PRECHECK_BYTES
from kiln.serving.prompt_bounds import MAX_REQUEST_BYTES, PromptBounds

from runtime_support import get_engine, random_prompts
from test_serving_openai import API_KEY, AUTH, MODEL, VOCAB, start_server

TIMEOUT_S = 5   # the server's header and body read timeouts, and its keep-alive timeout here
MAX_CONNECTIONS = 8
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return get_engine(checkpoint_dir("llama"))


@pytest.fixture(scope="module")
def ref(engine):
    from kiln.runtime import LLM

    with LLM(engine) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    s = start_server(engine.directory, tmp_path_factory.mktemp("hostile") / "server.log", "--max-waiting", "16",
                     "--timeout-request-headers", str(TIMEOUT_S), "--timeout-request-body", str(TIMEOUT_S),
                     "--timeout-keep-alive", str(TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
                     "--metrics-require-key")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.log.read_text()[-3000:]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=30).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def error_of(r: httpx.Response) -> dict:
    return r.json()["error"]


pytestmark = pytest.mark.xdist_group("serving")


# ---- prompts too large for the engine -------------------------------------------------------------------
def test_big_prompts_are_refused_by_size_while_health_answers(server, ref):
    bounds = PromptBounds.of(ref.tokenizer, ref.engine.config.bounds.max_input_len)
    assert bounds.max_text_bytes is not None   # the test checkpoints' byte-level BPE has a byte bound
    attacks = {   # (path, body) -> (status, param, what the message says)
        "15 MB of text": (CMPL, {"prompt": "The kiln fires the clay. " * 600_000}, 400, "prompt", "bytes, more than"),
        "text just over the bound": (CMPL, {"prompt": "é" * (bounds.max_text_bytes // 2 + 1)}, 400, "prompt",
                                     f"at most {bounds.max_text_bytes} bytes"),
        # millions of JSON values are refused by their count before the body is parsed (which would hold the GIL)
        "3M token ids": (CMPL, {"prompt": [5] * 3_000_000}, 400, None, "holds 3000003 JSON values"),
        "100k messages": (CHAT, {"messages": [{"role": "user", "content": ""}] * 100_000}, 400, None,
                          "holds 300003 JSON values"),
        "30k token ids (under the count)": (CMPL, {"prompt": [5] * 30_000}, 400, "prompt", "30000 tokens, more than"),
    }
    health: list[int] = []
    done = threading.Event()

    def poll():
        with httpx.Client(timeout=60) as http:
            while not done.is_set():
                health.append(http.get(f"{server.url}/health").status_code)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    before = rss_mb(server.proc.pid)
    try:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
            for name, (path, body, status, param, says) in attacks.items():
                r = http.post(path, json={"model": MODEL, "max_tokens": 4, **body})
                assert r.status_code == status and error_of(r)["param"] == param, (name, r.text[:300])
                assert says in error_of(r)["message"], (name, error_of(r)["message"])
            threads = [threading.Thread(target=http.post, args=(CMPL,), kwargs={"json": {
                "prompt": f"{i} " + "x" * (5 << 20), "max_tokens": 4}}) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        done.set()
        poller.join()
    assert health and set(health) == {200}
    # the bodies and their parse are gone: the server's memory is back (within the allocator's slack)
    assert rss_mb(server.proc.pid) - before < 64, (before, rss_mb(server.proc.pid))


def test_request_bodies_over_the_cap_get_413(server):
    big = b'{"prompt": "' + b"x" * MAX_REQUEST_BYTES + b'"}'
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        r = http.post(CMPL, content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "larger than 16 MiB" in error_of(r)["message"]

        def chunks():   # no Content-Length: refused once the cap is read
            for i in range(0, len(big), 1 << 20):
                yield big[i:i + (1 << 20)]

        r = http.post(CMPL, content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and error_of(r)["type"] == "invalid_request_error"


def test_large_bodies_are_parsed_and_tokenized_off_the_loop_and_answer_right(server, ref):
    """16 prompts of 90 token ids, indented (a 70 kB body: the prompt workers' path, its JSON values counted before
    it is parsed), equal LLM.generate."""
    prompts = random_prompts(16, VOCAB, 90, 90, seed=22)
    wants = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    body = json.dumps({"model": MODEL, "prompt": prompts, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
                      indent=48)
    assert len(body) > PRECHECK_BYTES
    r = httpx.post(f"{server.url}{CMPL}", content=body, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == [w.text for w in wants]


# ---- slow and silent connections, the connection limit --------------------------------------------------
def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes the connection; AssertionError if it has not within ``timeout``."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open for {timeout} s; it sent {data[:200]!r}") from None
    except ConnectionResetError:
        pass
    return data


def test_slow_and_silent_clients_get_408_and_are_closed(server):
    host, port = server.url.removeprefix("http://").split(":")
    connect = lambda: socket.create_connection((host, int(port)))   # noqa: E731
    silent = connect()
    half = connect()
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    trickle_stop = threading.Event()

    def trickle():   # a header line every 0.5 s: the deadline counts from the first byte, not the last
        while not trickle_stop.wait(0.5):
            try:
                half.sendall(b"X-Slow: 1\r\n")
            except OSError:
                return

    short = connect()
    short.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000000\r\n\r\n{\"prompt\":")
    threading.Thread(target=trickle, daemon=True).start()
    try:
        # a normal request is served meanwhile
        r = httpx.post(f"{server.url}{CMPL}", headers=AUTH, json={"prompt": [5, 6], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        for sock, what in ((silent, "headers"), (half, "headers"), (short, "body")):
            data = read_until_closed(sock, 6 * TIMEOUT_S)
            assert data.startswith(b"HTTP/1.1 408 "), (what, data[:200])
            assert f"the request {what} did not arrive within {TIMEOUT_S} s".encode() in data, data
    finally:
        trickle_stop.set()
        for sock in (silent, half, short):
            sock.close()
    # an idle kept-alive connection is closed after --timeout-keep-alive, without a response
    idle = connect()
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data = read_until_closed(idle, 6 * TIMEOUT_S)
    assert data.startswith(b"HTTP/1.1 200 ") and data.count(b"HTTP/1.1") == 1
    idle.close()


def test_connections_beyond_the_limit_get_503(server):
    host, port = server.url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port))) for _ in range(MAX_CONNECTIONS)]
    try:
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")   # half a request: each holds a connection
        r = httpx.get(f"{server.url}/health", timeout=30)
        assert r.status_code == 503, r.text
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 30
    while (code := httpx.get(f"{server.url}/health", timeout=30).status_code) != 200 and time.monotonic() < deadline:
        time.sleep(0.1)   # uvicorn forgets a closed connection when its event loop sees the close
    assert code == 200


# ---- admission and its counter ---------------------------------------------------------------------------
def test_choices_count_against_max_waiting_and_the_batch(server):
    rejected = metric(server, "kiln_requests_rejected_total")
    refusals = 0
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for body, param, says in [
            ({"prompt": "x", "n": 100}, "n", "n=100 is more than this server's max_batch_size 16"),
            ({"prompt": ["x", "y"], "n": 9}, "prompt", "18 choices, more than this server admits at once "
                                                        "(--max-waiting 16)"),
            ({"prompt": [5] * 97}, "prompt", "97 tokens, more than this engine's max_input_len 96"),
        ]:
            r = http.post(CMPL, json={"max_tokens": 2, **body})
            assert r.status_code == 400 and error_of(r)["param"] == param and says in error_of(r)["message"], r.text
            refusals += 1
        r = http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "n": 17})
        assert r.status_code == 400 and error_of(r)["param"] == "n"
        refusals += 1

    async def burst():   # 4 requests of 16 choices at once (each choice waits for its prefill): 64 for 16 places
        limits = httpx.Limits(max_connections=4)   # (the server takes 8 connections)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60, limits=limits) as http:
            body = {"prompt": random_prompts(1, VOCAB, 90, 90, seed=5)[0], "n": 16, "max_tokens": 8,
                    "ignore_eos": True, "temperature": 1.0}
            return await asyncio.gather(*(http.post(CMPL, json=body) for _ in range(4)))

    codes = []
    for _ in range(5):   # until a burst overlapped (each almost always does)
        codes = [r.status_code for r in asyncio.run(burst())]
        assert set(codes) <= {200, 429} and 200 in codes, codes
        refusals += codes.count(429)
        if 429 in codes:
            break
    assert 429 in codes
    assert metric(server, "kiln_requests_rejected_total") == rejected + refusals


# ---- authentication, /metrics, /docs ---------------------------------------------------------------------
def test_bearer_is_case_insensitive_metrics_need_the_key_and_there_is_no_docs(server, engine, monkeypatch):
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
        assert r.status_code == 200, scheme
    for value in (f"Basic {API_KEY}", f"Bearer {API_KEY}x", "Bearer", API_KEY):
        r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": value})
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key", value
    assert httpx.get(f"{server.url}/metrics").status_code == 401   # --metrics-require-key
    assert httpx.get(f"{server.url}/metrics", headers=AUTH).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200    # health stays open (load balancers)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 404, path
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    r = CliRunner().invoke(main, ["serve", str(engine.directory), "--metrics-require-key"])
    assert r.exit_code == 2 and "--metrics-require-key needs --api-key" in r.output


# ---- Triton (`kiln serve --frontend triton`): what kiln's model refuses, and what tritonserver answers itself ----
@pytest.fixture(scope="module")
def triton(checkpoint_dir, tmp_path_factory):
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient")
    from test_serving_triton import BUILD, CHECKPOINT
    from test_serving_triton import start_server as start_triton

    engine = get_engine(checkpoint_dir("llama", **CHECKPOINT), **BUILD)
    # one response per request (the session server of test_serving_triton streams): gRPC's unary infer, whose
    # errors carry a status code (a stream's carry only a message); integer inputs INT64, so that JSON numbers
    # arrive unwrapped (test_serving_triton's server has TensorRT-LLM's INT32)
    served = start_triton(engine.directory, tmp_path_factory.mktemp("triton-hostile"), "--max-kv-cache-tokens", "4096",
                          "--no-decoupled", "--int64-inputs")
    yield served, engine
    code, _ = served.stop()
    assert code == 0, served.output()[-3000:]


def generate(served, body: dict | bytes, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{served.http}/v2/models/kiln/generate", content=data, timeout=timeout)
    return r.status_code, r.json()


def grpc_error(served, arrays: dict, parameters: dict | None = None) -> tuple[str, str]:
    """(status, message) of the error a gRPC infer request gets."""
    import tritonclient.grpc as grpcclient
    from test_serving_triton import grpc_inputs
    from tritonclient.utils import InferenceServerException

    with grpcclient.InferenceServerClient(served.grpc) as client:
        try:
            client.infer("kiln", grpc_inputs(**arrays), parameters=parameters, client_timeout=60)
        except InferenceServerException as exc:
            return exc.status(), exc.message()
    raise AssertionError("the request was served")


@pytest.mark.xdist_group("triton")
def test_triton_refuses_by_size_and_by_name_with_400(triton):
    import numpy as np
    from test_serving_triton import request, tensor

    served, engine = triton
    bounds = engine.config.bounds
    max_text = PromptBounds.of(ref_tokenizer(engine), bounds.max_input_len).max_text_bytes
    for body, says in [
        ({"text_input": "hi", "max_tokens": 4, "foo": 1}, "unknown field(s) 'foo': not an input of this model"),
        ({"text_input": "hi", "max_tokens": 4, "parameters": {"bar": True}}, "'bar'"),
        ({"text_input": "x" * (max_text + 1), "max_tokens": 4}, f"at most {max_text} bytes"),
        ({"text_input": "x" * (MAX_REQUEST_BYTES + 1), "max_tokens": 4}, "more than 16 MiB"),
        ({"input_ids": [5] * (bounds.max_input_len + 1), "max_tokens": 4}, "more than the engine's max_input_len"),
    ]:
        status, answer = generate(served, body)
        assert status == 400 and says in answer["error"], (status, str(answer)[:300])
    status, answer = generate(served, {"text_input": "hi", "max_tokens": 4, "id": "my-request"})
    assert status == 200 and answer["num_output_tokens"] >= 1   # a request id is not an unknown field
    # gRPC: client errors are INVALID_ARGUMENT, and numbers at the ends of INT64 are checked as they are
    int64 = np.iinfo(np.int64)

    def ask(max_tokens: int, **extra) -> dict:
        return {**request("hi" if "input_ids" not in extra else None, None),
                "max_tokens": tensor(max_tokens, np.int64), **extra}

    for arrays, parameters, says in [
        (ask(4), {"foo": 1}, "unknown field(s) 'foo'"),
        (ask(int(int64.max)), None, f"exceeds the engine's max_seq_len {bounds.max_seq_len}"),
        (ask(int(int64.min)), None, f"max_tokens must be >= 1, got {int64.min}"),
        (ask(4, min_tokens=tensor(int(int64.min), np.int64)), None, "min_tokens must be in"),
        (ask(4, end_id=tensor(int(int64.max), np.int64)), None, "end_id must be a token id"),
        (ask(4, input_ids=tensor([5, 2**40], np.int64)), None, "outside the vocabulary"),
        (ask(4, input_ids=tensor([5, 6], np.int64), input_lengths=tensor(int(int64.max), np.int64)),
         None, "input_lengths must be in [1, 2]"),
        # the price of INT64 inputs: TensorRT-LLM's clients' INT32 is refused, by tritonserver
        (request("hi", 4), None, "expects 'INT64'"),
    ]:
        status, message = grpc_error(served, arrays, parameters)
        assert status == "StatusCode.INVALID_ARGUMENT" and says in message, (status, message)


def ref_tokenizer(engine):
    from kiln.runtime.detokenizer import load_tokenizer

    return load_tokenizer(engine.directory)


@pytest.mark.xdist_group("triton")
def test_triton_big_prompts_do_not_hold_up_others_or_keep_memory(triton):
    """Big prompts are refused while a normal one is served, and refusing them keeps nothing. The baseline is taken
    after one burst: tritonserver's and the stub's allocators keep their high-water mark (tritonserver's RSS swings
    50-160 MB between bursts of the same size, 2026-12-03), which is reuse, not a leak; four more bursts (12 prompts,
    180 MB of text) then fit in 120 MB, which keeping one copy of each prompt would not."""
    served, _ = triton
    rss = lambda: sum(rss_mb(pid) for pid in served.processes())   # noqa: E731  (tritonserver + its stub)
    status, _ = generate(served, {"text_input": "warm", "max_tokens": 2})
    assert status == 200
    answers: dict[str, tuple[int, dict]] = {}

    def burst(rnd: int, with_normal: bool) -> None:
        big = [threading.Thread(target=lambda i=i: answers.__setitem__(f"big{i}", generate(
            served, {"text_input": f"{rnd} {i} " + "The kiln fires the clay. " * 600_000, "max_tokens": 4})))
            for i in range(3)]
        for t in big:
            t.start()
        if with_normal:
            answers["normal"] = generate(served, {"text_input": "The kiln", "max_tokens": 4})
            assert answers["normal"][0] == 200, answers["normal"]
        for t in big:
            t.join()
        assert all(answers[f"big{i}"][0] == 400 for i in range(3)), {k: v[0] for k, v in answers.items()}

    burst(0, with_normal=True)
    time.sleep(1)
    before = rss()
    for rnd in range(1, 5):
        burst(rnd, with_normal=rnd == 1)
    time.sleep(1)
    assert rss() - before < 120, (before, rss())


@pytest.mark.xdist_group("triton")
def test_triton_server_gives_big_buffers_back_and_the_stub_keeps_glibc_defaults(triton):
    """tritonserver runs with a fixed mmap threshold (its prompt-sized buffers are given back on free); the stub,
    which runs the engine, with glibc's default dynamic one."""
    served, _ = triton
    envs = {}
    for pid in served.processes():
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        envs[Path(cmd.decode()).name] = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"MALLOC_MMAP_THRESHOLD_=1048576" in envs["tritonserver"], sorted(envs)
    assert not any(v.startswith(b"MALLOC_MMAP_THRESHOLD_=") for v in envs["triton_python_backend_stub"]), sorted(envs)


@pytest.mark.xdist_group("triton")
def test_triton_own_json_parser_answers_500_and_integers_arrive_unwrapped(triton):
    """What kiln cannot change (docs/serving-security.md): tritonserver parses /generate's JSON before the model
    sees a request, and its parse errors are 500s. It casts JSON integers to the input's declared type without a
    range check: with INT64 inputs 2**32 + 5 arrives as sent and is refused by name (with TensorRT-LLM's INT32 it
    would arrive as 5)."""
    served, _ = triton
    for body in [b'{"text_input": "hi", "max_tokens": 4', b"[1, 2]", {"text_input": "hi", "max_tokens": "5"},
                 {"text_input": "hi", "max_tokens": 1.5}, {"text_input": 5, "max_tokens": 4},
                 {"text_input": "hi", "max_tokens": 4, "seed": -1}, {"text_input": "hi", "max_tokens": 4,
                                                                    "seed": 2**64 + 7}]:
        status, answer = generate(served, body)
        assert status == 500 and "error" in answer, (body, status, answer)
    for body, says in [
        ({"max_tokens": 2**32 + 5}, f"max_tokens ({2**32 + 5}) exceeds the engine's max_seq_len"),
        ({"max_tokens": 2**31}, f"max_tokens ({2**31}) exceeds"),
        ({"max_tokens": 4, "min_tokens": 2**32 + 1}, f"min_tokens must be in [0, max_tokens=4], got {2**32 + 1}"),
        ({"max_tokens": 4, "end_id": 2**32 + 1}, f"got {2**32 + 1}"),
        ({"max_tokens": 4, "top_k": -(2**40)}, "top_k must be >= 0"),
    ]:
        status, answer = generate(served, {"text_input": "hi", **body})
        assert status == 400 and says in answer["error"], (body, status, answer)
