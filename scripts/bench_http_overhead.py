"""What HTTP costs: the same streaming workload in-process (``LLM.generate_async``) and through ``kiln serve``
(OpenAI API, server-sent events), in one run, alternating the two modes so machine noise hits both.

Each request's TTFT is measured by its client from sending the request to receiving the first token, and
its TPOT as (last token time - first token time) / (tokens - 1); the table gives p50/p95 over requests and
the HTTP overhead relative to in-process. Every request generates exactly ``--max-tokens`` tokens
(``ignore_eos``), so both modes do the same work. The HTTP clients are httpx streams in this process.

    .venv/bin/python scripts/bench_http_overhead.py                  # small Llama, built on first run
    .venv/bin/python scripts/bench_http_overhead.py --size 246m --requests 16 --max-tokens 32
    .venv/bin/python scripts/bench_http_overhead.py --engine DIR --concurrency 16 --requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench_common import BENCH, engine_is_current, ensure_checkpoint, log

BUILD = dict(max_batch_size=16, max_input_len=256, max_seq_len=512, max_num_tokens=512, tokens_per_block=16)


def ensure_engine(size: str, dtype: str, backend: str) -> Path:
    from kiln.builder import BuildConfig, build_engine

    engine_dir = BENCH / f"llama-{size}-{dtype}-{backend}-http-engine"
    build = {**BUILD, "backend": backend, "dtype": dtype}
    if not engine_is_current(engine_dir, build):
        ckpt = ensure_checkpoint(size)
        log(f"building {engine_dir.name} ...")
        build_engine(ckpt, engine_dir, BuildConfig(**build))
    return engine_dir


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def request_times(start: float, event_times: list[float], num_tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) from the send time and the arrival time of each event that carried tokens; TPOT as the
    runtime defines it: (last - first) / (tokens - 1)."""
    return event_times[0] - start, (event_times[-1] - event_times[0]) / (num_tokens - 1)


async def run_inprocess(llm, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[tuple[float, float]]:
    from kiln.runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sem = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with sem:
            start, times, n = time.perf_counter(), [], 0
            async for out in llm.generate_async(prompt, params):
                times.append(time.perf_counter())
                n += len(out.delta_token_ids)
            assert n == max_tokens
            return request_times(start, times, n)

    return await asyncio.gather(*(one(p) for p in prompts))


async def run_http(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[tuple[float, float]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(http: httpx.AsyncClient, prompt):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with sem:
            start, times, n = time.perf_counter(), [], 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        event = json.loads(line[6:])
                        if event["choices"]:
                            times.append(now)
                        elif event.get("usage"):
                            n = event["usage"]["completion_tokens"]
            assert n == max_tokens
            return request_times(start, times, n)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        return await asyncio.gather(*(one(http, p) for p in prompts))


def thread_cpu_seconds(pid: int, tid: int) -> float:
    """CPU time (user + system) of one thread of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(engine_dir: Path, options: list[str], threads: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kiln.runtime.cli", "serve", str(engine_dir), "--port", "0", "--log-level", "warning",
           *options]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)})
    for line in proc.stdout:
        if m := re.search(r"listening on (http://\S+) ", line):
            return proc, m.group(1)
    raise SystemExit(f"kiln serve exited with {proc.wait()} before listening")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, help="engine directory (default: a small Llama built on first run)")
    ap.add_argument("--size", default="small", choices=["small", "246m", "300m"], help="synthetic_checkpoints preset")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cpu-compiled"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of (in-process, HTTP)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of both (default: torch's, the cores)")
    args = ap.parse_args()

    import torch

    from kiln.runtime import LLM, Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    engine_dir = args.engine or ensure_engine(args.size, args.dtype, args.backend)
    config = Engine.read_config(engine_dir)
    vocab = config.model.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    # distinct prompts: no prefix reuse between requests; the same runtime options in both modes
    options = {"max_batch_size": args.concurrency}
    log(f"engine {engine_dir} ({config.model.architecture}, {config.backend}, {config.dtype}); "
        f"{args.requests} requests, concurrency {args.concurrency}, prompt {args.prompt_len}, "
        f"{args.max_tokens} tokens each, {threads} torch threads")
    llm = LLM(engine_dir, **options)
    proc, url = start_server(engine_dir, ["--max-batch-size", str(args.concurrency)], threads)
    results: dict[str, list[tuple[float, float]]] = {"in-process": [], "HTTP (kiln serve)": []}
    # CPU time of the threads that move tokens to clients: the in-process consumer (this thread) and the
    # server's event loop (its main thread); the machine's load moves latencies, much less these
    cpu = {"consumer": 0.0, "server loop": 0.0, "http client": 0.0}
    try:
        # warm-up: each process meets every shape of the workload once (first runs of a shape are slow)
        asyncio.run(run_inprocess(llm, prompts, args.max_tokens, args.concurrency))
        asyncio.run(run_http(url, prompts, args.max_tokens, args.concurrency))
        for r in range(args.repeats):
            c0 = time.thread_time()
            local = asyncio.run(run_inprocess(llm, prompts, args.max_tokens, args.concurrency))
            c1, s1 = time.thread_time(), thread_cpu_seconds(proc.pid, proc.pid)
            remote = asyncio.run(run_http(url, prompts, args.max_tokens, args.concurrency))
            cpu["consumer"] += c1 - c0
            cpu["http client"] += time.thread_time() - c1
            cpu["server loop"] += thread_cpu_seconds(proc.pid, proc.pid) - s1
            results["in-process"] += local
            results["HTTP (kiln serve)"] += remote
            tpot_local, tpot_remote = (percentile([x[1] for x in rows], 50) * 1e3 for rows in (local, remote))
            log(f"round {r + 1}/{args.repeats}: TPOT p50 in-process {tpot_local:.2f} ms, HTTP {tpot_remote:.2f} ms")
    finally:
        llm.shutdown()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)

    header = "".join(f"{h:>10}" for h in ("TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95"))
    print(f"\n{'mode':<18}{header}   (ms, {len(results['in-process'])} requests each)")
    table = {}
    for mode, rows in results.items():
        ttft, tpot = [r[0] * 1e3 for r in rows], [r[1] * 1e3 for r in rows]
        table[mode] = (percentile(ttft, 50), percentile(ttft, 95), percentile(tpot, 50), percentile(tpot, 95))
        print(f"{mode:<18}" + "".join(f"{v:10.2f}" for v in table[mode]))
    base, http = table["in-process"], table["HTTP (kiln serve)"]
    names = ("TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95")
    print("HTTP overhead:     " + ", ".join(f"{n} {100 * (h / b - 1):+.1f}%" for n, b, h in zip(names, base, http)))
    print(f"(TPOT p50 target: within 5% -> {'met' if http[2] <= 1.05 * base[2] else 'NOT met'}; "
          f"mean TPOT in-process {statistics.mean(r[1] for r in results['in-process']) * 1e3:.2f} ms)")
    tokens = args.repeats * args.requests * args.max_tokens
    print("CPU per generated token: " + ", ".join(f"{k} {v / tokens * 1e6:.0f} us" for k, v in cpu.items()) +
          f" (server loop = HTTP parsing, SSE chunks, sends; a step of {args.concurrency} sequences emits "
          f"{args.concurrency} tokens)")


if __name__ == "__main__":
    main()
