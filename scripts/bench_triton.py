"""Triton serving overhead (not a test): one workload served in-process (kiln's ``LLM``) and through Triton
Inference Server (gRPC streaming to the tritonserver of the ``kiln-llm[triton]`` extra), one after the other in
one run, TTFT/TPOT p50/p95 (and e2e p50) side by side.

    .venv/bin/python scripts/bench_triton.py [--size small] [--requests 32] [--rate 2] [--runs 4]

Both sides are timed the same way, from the client's point of view: TTFT = first token received - request
sent, TPOT = (last token - first token) / (tokens - 1) (so a first token that arrives late makes TPOT look
smaller: read it with TTFT and e2e = last token - request sent). In-process, the client is the ``submit`` callback;
through Triton, it is the gRPC stream callback in this process (the model runs in Triton's backend stub, a
separate process, with the same runtime options). Greedy, ``ignore_eos`` (end_id -1): every request generates
exactly its output length, and both sides must produce the same tokens. Arrivals: Poisson at --rate, the
same schedule for both. The server and the in-process LLM are started once and stay up; ``--runs`` pairs
of runs alternate the order (ABBA...) to average out the shared machine's drift, and the TPOT ratio is the
median of the pairs' ratios. CPU per token (user + system seconds of this process, plus the server and its
backend stub for Triton, per generated token) is the measure least disturbed by other load.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench_common import BENCH, engine_is_current, ensure_checkpoint, log


def ensure_engine(size: str, dtype: str, max_batch_size: int) -> Path:
    from kiln.builder import BuildConfig, build_engine

    ckpt = ensure_checkpoint(size)
    build = dict(dtype=dtype, max_batch_size=max_batch_size, max_input_len=512, max_seq_len=768, max_num_tokens=256,
                 tokens_per_block=16)
    out = BENCH / f"engine-triton-{size}-{dtype}-b{max_batch_size}"
    if not engine_is_current(out, build):
        log(f"building a {size} {dtype} engine into {out} ...")
        build_engine(ckpt, out, BuildConfig(**build))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_workload(n: int, rate: float, seed: int, vocab: int, prompt_len, output_len) -> list[dict]:
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        reqs.append(dict(id=i, arrival=t, prompt=[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))],
                         max_tokens=rng.randint(*output_len)))
    return reqs


class Timeline:
    """Client-side times of each request: sent, every token received."""

    def __init__(self, workload: list[dict]):
        self.sent: dict[int, float] = {}
        self.token_times: dict[int, list[float]] = {r["id"]: [] for r in workload}
        self.tokens: dict[int, list[int]] = {r["id"]: [] for r in workload}
        self.remaining = len(workload)
        self.done = threading.Event()
        self.lock = threading.Lock()

    def received(self, rid: int, token_ids, final: bool) -> None:
        now = time.monotonic()
        if len(token_ids):
            self.token_times[rid].extend([now] * len(token_ids))
            self.tokens[rid].extend(int(t) for t in token_ids)
        if final:
            with self.lock:
                self.remaining -= 1
                if self.remaining == 0:
                    self.done.set()

    def rows(self) -> list[dict]:
        out = []
        for rid, times in self.token_times.items():
            n = len(times)
            out.append(dict(ttft=times[0] - self.sent[rid], tpot=(times[-1] - times[0]) / (n - 1) if n > 1 else None,
                            e2e=times[-1] - self.sent[rid], end=times[-1], tokens=n))
        return out


def replay(workload: list[dict], send) -> tuple[Timeline, float]:
    """Send each request at its arrival time (``send(request, timeline)``); wait for all to finish."""
    timeline = Timeline(workload)
    t0 = time.monotonic()
    for r in workload:
        delay = t0 + r["arrival"] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        timeline.sent[r["id"]] = time.monotonic()
        send(r, timeline)
    if not timeline.done.wait(1800):
        raise TimeoutError("the workload did not finish within 30 minutes")
    return timeline, t0


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of processes (from /proc), in seconds."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def run_in_process(llm, workload: list[dict]) -> tuple[Timeline, float]:
    from kiln.runtime import SamplingParams

    def send(r, timeline):
        llm.submit(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True),
                   callback=lambda out, rid=r["id"]: timeline.received(rid, out.delta_token_ids, out.finished))

    return replay(workload, send)


def grpc_request(prompt: list[int], max_tokens: int) -> list:
    import tritonclient.grpc as grpcclient

    arrays = {"input_ids": (np.array([prompt], np.int32), "INT32"),
              "max_tokens": (np.array([[max_tokens]], np.int32), "INT32"),
              "end_id": (np.array([[-1]], np.int32), "INT32"), "stream": (np.array([[True]]), "BOOL")}
    inputs = []
    for name, (arr, dtype) in arrays.items():
        x = grpcclient.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        inputs.append(x)
    return inputs


class TritonClient:
    """One gRPC stream carrying every request of a run (as load generators do)."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.timeline: Timeline | None = None
        self.errors: queue.SimpleQueue = queue.SimpleQueue()
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error) -> None:
        if error is not None:
            self.errors.put(error)
            if self.timeline is not None:
                self.timeline.done.set()
            return
        rid = int(result.get_response().id)
        self.timeline.received(rid, result.as_numpy("output_ids").reshape(-1),
                               result.as_numpy("finish_reason") is not None)

    def run(self, workload: list[dict]) -> tuple[Timeline, float]:
        def send(r, timeline):
            self.timeline = timeline
            self.client.async_stream_infer("kiln", grpc_request(r["prompt"], r["max_tokens"]), request_id=str(r["id"]))

        result = replay(workload, send)
        if not self.errors.empty():
            raise RuntimeError(f"Triton returned an error: {self.errors.get()}")
        return result

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def run_triton(url: str, workload: list[dict]) -> tuple[Timeline, float]:
    """The workload over a gRPC stream opened for this run only (no client threads during in-process runs)."""
    client = TritonClient(url)
    try:
        return client.run(workload)
    finally:
        client.close()


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    pos = (len(xs) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(timeline: Timeline, t0: float, cpu: float) -> dict:
    rows = timeline.rows()
    span = max(r["end"] for r in rows) - t0
    tokens = sum(r["tokens"] for r in rows)
    return dict(ttft_p50=pct([r["ttft"] for r in rows], 50), ttft_p95=pct([r["ttft"] for r in rows], 95),
                tpot_p50=pct([r["tpot"] for r in rows], 50), tpot_p95=pct([r["tpot"] for r in rows], 95),
                e2e_p50=pct([r["e2e"] for r in rows], 50),
                tok_per_s=tokens / span, cpu_ms_per_token=cpu / tokens * 1e3, span=span)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=["tiny", "small", "246m", "300m"],
                    help="random Llama preset (kiln.model_defs.synthetic)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[64, 192], metavar=("MIN", "MAX"))
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--max-kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--runs", type=int, default=4, help="pairs of in-process / Triton runs, order alternating")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    from kiln.runtime import Engine, ExecutorConfig
    from kiln.serving.triton.launcher import Ports, TritonServer
    from kiln.serving.triton.repository import RepoOptions, render_repository

    engine_dir = ensure_engine(args.size, args.dtype, args.max_batch_size)
    vocab = Engine.read_config(engine_dir).model.vocab_size
    workload = make_workload(args.requests, args.rate, args.seed, vocab, args.prompt_len, args.output_len)
    options = dict(max_batch_size=args.max_batch_size, max_kv_cache_tokens=args.max_kv_cache_tokens)
    log(f"workload: {len(workload)} requests, Poisson {args.rate} req/s, prompts {args.prompt_len}, outputs "
        f"{args.output_len} ({sum(r['max_tokens'] for r in workload)} tokens), engine {engine_dir.name}")

    from kiln.runtime import LLM

    names = ("in-process LLM", "Triton gRPC streaming")
    results: dict[str, list[dict]] = {name: [] for name in names}
    tokens: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-triton-") as tmp:
        render_repository(engine_dir, Path(tmp) / "repository", RepoOptions(runtime=ExecutorConfig(**options)))
        log("starting tritonserver and the in-process LLM (both stay up; runs alternate) ...")
        server = TritonServer(Path(tmp) / "repository", Path(tmp), Ports(free_port(), free_port(), free_port()))
        server.start()
        llm = None
        try:
            server.wait_ready(600)
            llm = LLM(engine_dir, **options)
            warm = make_workload(2, 100.0, args.seed + 1, vocab, (64, 64), (4, 4))
            run_in_process(llm, warm)
            run_triton(server.urls["grpc"], warm)
            for run in range(args.runs):
                for name in (names if run % 2 == 0 else names[::-1]):
                    log(f"run {run + 1}/{args.runs}: {name} ...")
                    pids = [os.getpid()] + ([] if name == names[0] else server.processes())
                    cpu0 = cpu_seconds(pids)
                    if name == names[0]:
                        timeline, t0 = run_in_process(llm, workload)
                    else:
                        timeline, t0 = run_triton(server.urls["grpc"], workload)
                    results[name].append(summarize(timeline, t0, cpu_seconds(pids) - cpu0))
                    tokens[name] = timeline.tokens
        finally:
            if llm is not None:
                llm.shutdown()
            server.stop()
    same = tokens["in-process LLM"] == tokens["Triton gRPC streaming"]

    print()
    print(f"{len(workload)} requests, Poisson {args.rate} req/s, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
          f"outputs {args.output_len[0]}-{args.output_len[1]}, {args.size} {args.dtype}, kiln max_batch_size "
          f"{args.max_batch_size}, {args.runs} alternating runs (median of runs); tokens identical: {same}")
    print(f"{'':24} {'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} {'TPOT p95':>9} {'e2e p50':>9} "
          f"{'out tok/s':>10} {'CPU/token':>10}")
    med = {}
    for name, runs in results.items():
        med[name] = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
        m = med[name]
        print(f"{name:24} {m['ttft_p50'] * 1e3:7.1f}ms {m['ttft_p95'] * 1e3:7.1f}ms {m['tpot_p50'] * 1e3:7.2f}ms "
              f"{m['tpot_p95'] * 1e3:7.2f}ms {m['e2e_p50']:8.2f}s {m['tok_per_s']:10.1f} "
              f"{m['cpu_ms_per_token']:8.2f}ms")
    a, b = med["in-process LLM"], med["Triton gRPC streaming"]
    ratios = [t["tpot_p50"] / i["tpot_p50"] for i, t in zip(*results.values())]
    print(f"Triton / in-process: TPOT p50 x{float(np.median(ratios)):.3f} (median of the runs' ratios "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; target <= 1.05), TTFT p50 x{b['ttft_p50'] / a['ttft_p50']:.3f}, "
          f"throughput x{b['tok_per_s'] / a['tok_per_s']:.3f}, "
          f"CPU per token x{b['cpu_ms_per_token'] / a['cpu_ms_per_token']:.3f} "
          "(server + stub + client vs this process)")
    print(f"machine load (1-min average) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          "(shared: compare within one run)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
