"""Hostile clients against `kiln serve` (not a test): what one big, malformed or slow request does to everyone
else, on both frontends, over loopback.

    .venv/bin/python scripts/bench_hostile.py [--frontend openai|triton|both] [--slow 1500]

OpenAI frontend (one server, started with --max-waiting 4):
- big prompts (4 MB and 15.9 MB of text, 5.5M token ids, a chat of 450k messages, 16 concurrent prompts of
  max_input_len tokens): the attack's status and seconds, and /health's worst and p99 latency meanwhile (polled
  every 20 ms on a kept-alive connection);
- memory: the server's RSS at rest, at its peak while 3 prompts of 5 MB are in flight, and 3 s after they were
  answered; the latency of one normal request sent while they are in flight;
- slowloris: ``--slow`` connections that send half a request's headers and then one header line every 5 s, plus
  50 that promise a 1 MB body and send 10 bytes: a normal request's latency while they are open, and how long
  the server keeps them (checked up to 45 s);
- admission: n=100 against --max-waiting 4, and kiln_requests_rejected_total after a burst that gets 429s.

Triton frontend (`kiln serve --frontend triton`, HTTP /generate): the status and message of each bad input,
/v2/health/ready during a 4 MB prompt and a normal request sent right after it, a 20 MB body's status and
seconds, and tritonserver's RSS (server + backend stub) around it.

The engine is the tiny test Llama (vocab 512) built once with max_input_len 1024. Numbers are wall-clock on a
shared machine: read them as "blocked or not", not to the millisecond.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from bench_common import BENCH, ensure_engine, log

BUILD = dict(max_batch_size=8, max_input_len=1024, max_seq_len=2048, max_num_tokens=1024, tokens_per_block=16)
WORDS = "The kiln fires the clay slowly, and the potter waits by the door. "
SCALE = [1.0]   # --scale: attack sizes times this (a quick check of the script itself)


def big(n: int) -> int:
    return max(1, int(n * SCALE[0]))


def text_of(num_bytes: int) -> str:
    return (WORDS * (num_bytes // len(WORDS) + 1))[:num_bytes]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def session_pids(sid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


class Server:
    """`kiln serve` in its own session; RSS summed over that session and the processes that name ``work``
    (tritonserver and its backend stubs, which the launcher starts in a session of their own)."""

    def __init__(self, args: list[str], ready: str | None = None, http_port: int | None = None,
                 work: Path | None = None):
        cmd = [sys.executable, "-m", "kiln.runtime.cli", "serve", *args]
        self.work = work
        self.log = open(BENCH / "hostile-server.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and self.proc.poll() is None:
            text = (BENCH / "hostile-server.log").read_text(errors="replace")
            if ready and (m := re.search(ready, text)):
                self.host, self.port = m.group(1), int(m.group(2))
                return
            if http_port and "Triton is ready" in text:
                self.host, self.port = "127.0.0.1", http_port
                return
            time.sleep(0.2)
        raise SystemExit(f"the server did not start:\n{(BENCH / 'hostile-server.log').read_text()[-3000:]}")

    def pids(self) -> list[int]:
        pids = set(session_pids(self.proc.pid))
        if self.work is not None:
            needle = str(self.work).encode()
            for entry in Path("/proc").iterdir():
                try:
                    if entry.name.isdigit() and needle in (entry / "cmdline").read_bytes():
                        pids.add(int(entry.name))
                except OSError:
                    pass
        return sorted(pids)

    def rss(self) -> float:
        return rss_mb(self.pids())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def request(server: Server, method: str, path: str, body: bytes | None = None, timeout: float = 300,
            headers: dict | None = None) -> tuple[int, str, float]:
    """(status, the start of the body, seconds)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        data = r.read()
        return r.status, data[:200].decode(errors="replace"), time.perf_counter() - t0
    except (OSError, http.client.HTTPException) as exc:
        return 0, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0
    finally:
        conn.close()


class Probe:
    """Polls ``path`` every 20 ms on one kept-alive connection (latencies in ms), and the server's RSS every
    50 ms in another thread (its peak)."""

    def __init__(self, server: Server, path: str):
        self.server, self.path = server, path
        self.latencies: list[float] = []
        self.peak_rss = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._rss_thread = threading.Thread(target=self._watch_rss, daemon=True)

    def _watch_rss(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_rss = max(self.peak_rss, self.server.rss())

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=120)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                conn.request("GET", self.path)
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=120)
            self.latencies.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.02)
        conn.close()

    def __enter__(self) -> Probe:
        self._thread.start()
        self._rss_thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._rss_thread.join()

    def summary(self) -> str:
        xs = sorted(self.latencies)
        if not xs:
            return "no probe"
        p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        return f"{self.path} worst {xs[-1]:8.1f} ms, p99 {p99:8.1f} ms ({len(xs)} probes)"


def row(name: str, result: tuple[int, str, float], extra: str = "") -> None:
    status, body, seconds = result
    print(f"  {name:38} -> {status} in {seconds:6.2f} s  {extra}\n      {body[:150]!r}", flush=True)


def parallel(fns) -> list:
    out = [None] * len(fns)
    threads = [threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, f())) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@contextmanager
def sockets_open(server: Server, count: int, partial: bytes, trickle: bytes | None):
    """``count`` connections that sent ``partial``; ``trickle`` (if any) is sent on each every 5 s."""
    socks = []
    for _ in range(count):
        s = socket.create_connection((server.host, server.port))
        s.sendall(partial)
        s.setblocking(False)
        socks.append(s)
    stop = threading.Event()

    def trickler():
        while not stop.wait(5):
            for s in socks:
                try:
                    s.send(trickle)
                except OSError:
                    pass

    t = threading.Thread(target=trickler, daemon=True)
    if trickle:
        t.start()
    try:
        yield socks
    finally:
        stop.set()
        for s in socks:
            s.close()


def closed_by_server(s: socket.socket) -> bool:
    """True once the server answered (a 408) or closed the connection."""
    try:
        s.recv(65536)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def openai_attacks(engine_dir: Path, slow: int) -> None:
    from tokenizers import Tokenizer

    server = Server([str(engine_dir), "--port", "0", "--max-waiting", "4", "--log-level", "warning"],
                    ready=r"listening on http://([\d.]+):(\d+)")
    tok = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
    try:
        base = server.rss()
        log(f"OpenAI frontend at {server.host}:{server.port}; RSS at rest {base:.0f} MB")

        def completion(prompt, **kw) -> bytes:
            return json.dumps({"prompt": prompt, "max_tokens": 4, **kw}).encode()

        normal = completion("The kiln")
        row("warm-up: a normal request", request(server, "POST", "/v1/completions", normal))
        fit = text_of(BUILD["max_input_len"] * 8)
        while len(tok.encode(fit).ids) > BUILD["max_input_len"] - 8:
            fit = fit[: int(len(fit) * 0.95)]
        attacks = {
            "text prompt 4 MB": completion(text_of(big(4 << 20))),
            "text prompt 15.9 MB": completion(text_of(big((16 << 20) - 200_000))),
            "5.5M token ids": completion([5] * big(5_500_000)),
            "chat of 450k messages": json.dumps({"max_tokens": 4, "messages": [
                {"role": "user", "content": ""}] * big(450_000)}).encode(),
        }
        for name, body in attacks.items():
            path = "/v1/chat/completions" if "chat" in name else "/v1/completions"
            with Probe(server, "/health") as probe:
                result = request(server, "POST", path, body)
            row(f"{name} ({len(body) / 1e6:.1f} MB body)", result, probe.summary())
        with Probe(server, "/health") as probe:
            results = parallel([lambda: request(server, "POST", "/v1/completions", completion(fit))] * 16)
        row(f"16 x a prompt of <= {BUILD['max_input_len']} tokens ({len(fit)} B)",
            max(results, key=lambda r: r[2]), f"statuses {sorted({r[0] for r in results})}; {probe.summary()}")

        log("memory: 3 prompts of 5 MB in flight")
        rest = server.rss()
        with Probe(server, "/health") as probe:
            heavy = [threading.Thread(target=request, args=(server, "POST", "/v1/completions", completion(
                text_of(big(5 << 20)) + str(i)))) for i in range(3)]
            for t in heavy:
                t.start()
            time.sleep(0.5)
            normal_result = request(server, "POST", "/v1/completions", normal)
            for t in heavy:
                t.join()
        time.sleep(3)
        print(f"  RSS: at rest {rest:.0f} MB, peak {probe.peak_rss:.0f} MB, 3 s after {server.rss():.0f} MB; "
              f"{probe.summary()}")
        row("a normal request meanwhile", normal_result)

        log(f"slowloris: {slow} half-sent headers + 50 short bodies")
        with sockets_open(server, slow, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"X-Slow: 1\r\n") as heads, \
                sockets_open(server, 50, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                             b"\r\nContent-Length: 1000000\r\n\r\n{\"prompt\":", None) as bodies:
            time.sleep(2)
            row("a normal request meanwhile", request(server, "POST", "/v1/completions", normal))
            t0, closed = time.monotonic(), {}
            while time.monotonic() - t0 < 45 and len(closed) < len(heads) + len(bodies):
                for s in heads + bodies:
                    if id(s) not in closed and closed_by_server(s):
                        closed[id(s)] = time.monotonic() - t0 + 2
                time.sleep(0.5)
            for what, socks in (("half-sent headers", heads), ("short bodies", bodies)):
                times = [closed[id(s)] for s in socks if id(s) in closed]
                print(f"  {what}: {len(times)}/{len(socks)} closed by the server within 47 s"
                      + (f" (the last after {max(times):.1f} s)" if times else ""), flush=True)
        row("a normal request after", request(server, "POST", "/v1/completions", normal))

        log("admission")
        row("n=100 with --max-waiting 4", request(server, "POST", "/v1/completions", completion("The kiln", n=100)))
        burst = parallel([lambda: request(server, "POST", "/v1/completions", completion(
            "The kiln", max_tokens=64, ignore_eos=True))] * 16)
        refused = sum(r[0] == 429 for r in burst)
        text = urllib.request.urlopen(f"http://{server.host}:{server.port}/metrics", timeout=30).read().decode()
        rejected = re.findall(r"^kiln_requests_rejected_total(?:\{[^}]*\})? (\S+)", text, re.M)
        print(f"  burst of 16: {refused} got 429; kiln_requests_rejected_total {rejected}", flush=True)
    finally:
        server.stop()


def triton_attacks(engine_dir: Path) -> None:
    ports = [free_port() for _ in range(3)]
    work = BENCH / "hostile-triton-work"
    server = Server(["--frontend", "triton", str(engine_dir), "--http-port", str(ports[0]), "--grpc-port",
                     str(ports[1]), "--metrics-port", str(ports[2]), "--work-dir", str(work), "--quiet"],
                    http_port=ports[0], work=work)
    try:
        log(f"Triton frontend at {server.host}:{server.port}; RSS (server + stub) {server.rss():.0f} MB")
        gen = "/v2/models/kiln/generate"

        def body(**fields) -> bytes:
            return json.dumps({"text_input": "The kiln", "max_tokens": 5, **fields}).encode()

        row("warm-up: a normal request", request(server, "POST", gen, body()))
        bad = {
            "bad JSON": b'{"text_input": "The kiln", "max_tokens": 5',
            "a non-object body": b"[1, 2]",
            'max_tokens "5"': body(max_tokens="5"),
            "max_tokens 1.5": body(max_tokens=1.5),
            "text_input 5": body(text_input=5),
            "seed -1": body(seed=-1),
            "seed 2**64+7": body(seed=2**64 + 7),
            "max_tokens 4294967301 (2**32+5)": body(max_tokens=2**32 + 5),
            "max_tokens 2**31": body(max_tokens=2**31),
            "an unknown field": body(foo=1),
        }
        for name, data in bad.items():
            row(name, request(server, "POST", gen, data))
        with Probe(server, "/v2/health/ready") as probe:
            first = threading.Thread(target=lambda: row("text_input 4 MB", request(
                server, "POST", gen, body(text_input=text_of(big(4 << 20))))))
            first.start()
            time.sleep(0.2)
            normal_result = request(server, "POST", gen, body())
            first.join()
        print(f"  {probe.summary()}")
        row("a normal request 0.2 s after it", normal_result)
        rest = server.rss()
        with Probe(server, "/v2/health/ready") as probe:
            row("text_input 20 MB", request(server, "POST", gen, body(text_input=text_of(big(20 << 20)))))
        time.sleep(3)
        print(f"  RSS (server + stub): before {rest:.0f} MB, peak {probe.peak_rss:.0f} MB, "
              f"3 s after {server.rss():.0f} MB; {probe.summary()}")
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frontend", default="both", choices=["openai", "triton", "both"])
    ap.add_argument("--slow", type=int, default=1500, help="slowloris connections (half-sent headers)")
    ap.add_argument("--scale", type=float, default=1.0, help="attack sizes times this (1: the issue's sizes)")
    args = ap.parse_args()
    SCALE[0] = args.scale

    from bench_common import ensure_checkpoint

    engine_dir = ensure_engine("engine-hostile-tiny", BUILD, ensure_checkpoint("tiny"))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"kiln {head}; {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f}", flush=True)
    if args.frontend in ("openai", "both"):
        openai_attacks(engine_dir, args.slow)
    if args.frontend in ("triton", "both"):
        triton_attacks(engine_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
