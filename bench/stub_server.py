"""A zero-latency OpenAI-compatible completions server, to measure the benchmark client itself.

It answers ``POST /v1/completions`` (streaming) at once with ``max_tokens`` SSE chunks of one token each
and a usage chunk, and ``GET /v1/models``; it does no inference. ``kiln bench --dry-run`` replays the
workload against it: whatever latency and rate limits show there are the client's own.
``--reject-every N`` answers every Nth completion with HTTP 429 (the tests check that the client counts
rejections); ``GET /metrics`` exposes the streams open now as ``kiln_num_requests_running`` (kiln
serve's name), so the client's polling of a server's metrics is exercised too.

    python -m kiln.bench.stub_server --port 8011
"""

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

MODEL = "kiln-stub"


def make_app(reject_every: int = 0):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="kiln bench zero-latency stub")
    seen = [0]
    open_streams = [0]

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("# TYPE kiln_num_requests_running gauge\n"
                                 f"kiln_num_requests_running {open_streams[0]}\n"
                                 "# TYPE kiln_num_requests_waiting gauge\nkiln_num_requests_waiting 0\n")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "kiln"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen[0] += 1
        if reject_every and seen[0] % reject_every == 0:
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit"}}, status_code=429)
        body = await request.json()
        n = body.get("max_tokens")
        prompt = body.get("prompt")
        if not isinstance(n, int) or n < 1 or not prompt:
            error = {"message": "need a prompt and max_tokens >= 1", "type": "invalid_request_error"}
            return JSONResponse({"error": error},
                                status_code=400)
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        created = int(time.time())

        def chunk(text: str, finish: str | None) -> str:
            return "data: " + json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": created,
                                          "model": MODEL, "choices": [{"index": 0, "text": text,
                                                                       "finish_reason": finish}]}) + "\n\n"

        def stream() -> Iterator[str]:
            open_streams[0] += 1
            try:
                yield from body_chunks()
            finally:
                open_streams[0] -= 1

        def body_chunks() -> Iterator[str]:
            for i in range(n):
                yield chunk(" t", "length" if i == n - 1 else None)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            yield "data: " + json.dumps({"id": "cmpl-stub", "object": "text_completion", "created": created,
                                         "model": MODEL, "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> None:
    """Poll ``url`` until it answers 200; RuntimeError with the server's output if it dies or times out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready:\n{out[-2000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} was not ready within {timeout:.0f} s")


@contextlib.contextmanager
def running_stub(port: int | None = None, reject_every: int = 0) -> Iterator[str]:
    """Start the stub in a subprocess (its own interpreter, so it does not share the client's GIL); yield
    its base URL; always stop it."""
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.bench.stub_server", "--port", str(port),
                             "--reject-every", str(reject_every)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/v1/models", proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    import argparse

    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--reject-every", type=int, default=0, help="answer every Nth completion with HTTP 429")
    args = ap.parse_args()
    uvicorn.run(make_app(args.reject_every), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
