"""Triton serving overhead (not a test): one workload through kiln bench's in-process target (kiln's ``LLM``) and
its Triton target (gRPC streaming to ``kiln serve --frontend triton``'s model), in alternating pairs of runs in
one process; TTFT/TPOT p50/p95 and e2e side by side.

    .venv/bin/python scripts/bench_triton.py [--size small] [--requests 32] [--rate 2] [--pairs 4]
    .venv/bin/python scripts/bench_triton.py --size 246m --concurrency 8 --requests 32 --prompt-len 128 --output-len 32

With ``--concurrency N`` the workload is closed-loop instead of Poisson: N streams, each sending its next request
when the last one ends, so every step decodes about N sequences in both modes and TPOT compares the same steps
(a Poisson workload's TPOT also moves with how the requests happened to overlap in each run).

Both targets time requests the same way, from the client (kiln.bench.targets): TTFT = first token received -
request sent, TPOT = (last token - first token) / (tokens - 1) (a first token that arrives late makes TPOT look
smaller: read it with TTFT and e2e). Prompts are token ids, lengths forced (ignore_eos / end_id -1 + min_tokens),
greedy. The Triton server and the in-process LLM are started once with the same runtime options and stay up;
each pair sends the same prompts to both (fresh ones per pair, so no prefix-cache hits across pairs), the order
alternating (ABBA...) against the shared machine's drift; the TPOT ratio is the median of the pairs' ratios.
CPU per token (user + system seconds of this process, plus tritonserver and its backend stub for Triton, per
generated token) is the number least disturbed by other load. `kiln bench --api triton` runs the Triton side
alone, with its full report and plots.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench_common import ensure_checkpoint, ensure_engine, log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of processes (from /proc), in seconds."""
    return sum(cpu_by_process(pids).values())


def cpu_by_process(pids: list[int]) -> dict[str, float]:
    """User + system CPU seconds of processes by kind: this process ("client"), "tritonserver" and its Python
    backend "stub" (kiln's model: its step loop and its sender thread)."""
    out: dict[str, float] = {}
    for pid in pids:
        try:
            comm, fields = Path(f"/proc/{pid}/stat").read_text().split(" (", 1)[1].rsplit(")", 1)
            fields = fields.split()
            kind = "client" if pid == os.getpid() else "tritonserver" if comm == "tritonserver" else "stub"
            out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=["tiny", "small", "246m", "300m"],
                    help="random Llama preset (scripts/synthetic_checkpoints.py)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--prompt-len", default="32:256", help="N or LOW:HIGH")
    ap.add_argument("--output-len", default="64:192", help="N or LOW:HIGH")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--max-kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--concurrency", type=int, default=None,
                    help="closed loop: this many streams, each sending its next request when one ends (no --rate)")
    ap.add_argument("--pairs", type=int, default=4, help="pairs of in-process / Triton runs, order alternating")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    from kiln.bench import workload as wl
    from kiln.bench.runner import run_rate
    from kiln.bench.stats import summary
    from kiln.bench.targets import COMPLETED, InProcessTarget, RequestRecord, TritonTarget
    from kiln.runtime import LLM, Engine, ExecutorConfig
    from kiln.serving.triton.launcher import Ports, TritonServer
    from kiln.serving.triton.repository import RepoOptions, render_repository

    ckpt = ensure_checkpoint(args.size)
    engine_dir = ensure_engine(f"engine-triton-{args.size}-{args.dtype}-b{args.max_batch_size}", dict(
        dtype=args.dtype, max_batch_size=args.max_batch_size, max_input_len=512, max_seq_len=768, max_num_tokens=256,
        tokens_per_block=16), ckpt)
    vocab = Engine.read_config(engine_dir).model.vocab_size
    work = wl.synthetic_workload(args.requests, seed=args.seed, prompt_len=wl.LengthSpec.parse(args.prompt_len),
                                 output_len=wl.LengthSpec.parse(args.output_len)).at_rate(args.rate)
    synth = wl.PromptSynthesizer(vocab, args.seed)
    runtime = ExecutorConfig(max_batch_size=args.max_batch_size, max_kv_cache_tokens=args.max_kv_cache_tokens)
    arrivals = f"closed loop, {args.concurrency} streams" if args.concurrency else f"Poisson {args.rate} req/s"
    log(f"workload: {args.requests} requests, {arrivals}, prompts {args.prompt_len}, outputs "
        f"{args.output_len} ({work.totals()['output_tokens']} tokens), engine {engine_dir.name}")

    names = ("in-process LLM", "Triton gRPC streaming")
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-triton-") as tmp:
        render_repository(engine_dir, Path(tmp) / "repository", RepoOptions(runtime=runtime))
        log("starting tritonserver and the in-process LLM (both stay up; runs alternate) ...")
        server = TritonServer(Path(tmp) / "repository", Path(tmp), Ports(free_port(), free_port(), free_port()))
        server.start()
        llm = None
        try:
            server.wait_ready(600)
            llm = LLM(engine_dir, config=runtime)

            async def run_closed(target, run_index: int) -> dict:
                """The workload's requests through ``args.concurrency`` streams; the run dict run_rate returns,
                with the fields this script reads."""
                sem = asyncio.Semaphore(args.concurrency)
                records = [RequestRecord(spec.index, 0.0, spec.prompt_len, spec.output_len) for spec in work.requests]

                async def one(rec, spec):
                    async with sem:
                        await target.send(rec, synth.prompt(spec, run_index))

                start = time.perf_counter()
                await asyncio.gather(*(one(r, s) for r, s in zip(records, work.requests)))
                wall = time.perf_counter() - start
                done = [r for r in records if r.outcome == COMPLETED]
                return {"latency_s": {"ttft": summary(r.ttft for r in done), "tpot": summary(r.tpot for r in done),
                                      "e2e": summary(r.done - r.sent for r in done)},
                        "throughput": {"output_tokens_per_s": sum(r.output_tokens for r in done) / wall},
                        "per_request": [{"output_tokens": r.output_tokens} for r in records],
                        "requests": {"completed": len(done), "scheduled": len(records)}}

            async def run_workload(target, run_index: int) -> dict:
                if args.concurrency:
                    return await run_closed(target, run_index)
                return await run_rate(target, work, synth, progress=False, run_index=run_index)

            async def measure(name: str, run_index: int) -> dict:
                target = InProcessTarget(llm) if name == names[0] else TritonTarget(server.urls["grpc"])
                pids = [os.getpid()] + ([] if name == names[0] else server.processes())
                try:
                    if run_index == 0:   # unmeasured: the first runs of an engine's shapes are slower
                        await run_workload(target, 10_000)
                    for i in range(2):   # and the first requests of a connection
                        await target.send(RequestRecord(-1 - i, 0.0, 16, 4), synth.warmup_prompt(i, 16))
                    cpu0 = cpu_by_process(pids)
                    run = await run_workload(target, 1 + run_index)
                    cpu1 = cpu_by_process(pids)
                    run["cpu_by_process_s"] = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
                    run["cpu_s"] = sum(run["cpu_by_process_s"].values())
                    return run
                finally:
                    await target.close()

            for pair in range(args.pairs):
                for name in (names if pair % 2 == 0 else names[::-1]):
                    log(f"pair {pair + 1}/{args.pairs}: {name} ...")
                    results[name].append(asyncio.run(measure(name, pair)))
        finally:
            if llm is not None:
                llm.shutdown()
            server.stop()

    def row(run: dict) -> dict:
        lat, tokens = run["latency_s"], sum(r["output_tokens"] for r in run["per_request"])
        return dict(ttft_p50=lat["ttft"]["p50"], ttft_p95=lat["ttft"]["p95"], tpot_p50=lat["tpot"]["p50"],
                    tpot_p95=lat["tpot"]["p95"], e2e_p50=lat["e2e"]["p50"],
                    tok_per_s=run["throughput"]["output_tokens_per_s"], cpu_ms_per_token=run["cpu_s"] / tokens * 1e3,
                    **{f"cpu_ms_per_token_{k}": v / tokens * 1e3 for k, v in run["cpu_by_process_s"].items()},
                    completed=run["requests"]["completed"] == run["requests"]["scheduled"])

    rows = {name: [row(r) for r in runs] for name, runs in results.items()}
    print()
    print(f"{args.requests} requests, {arrivals}, prompts {args.prompt_len}, outputs {args.output_len}, "
          f"{args.size} {args.dtype}, kiln max_batch_size {args.max_batch_size}, {args.pairs} pairs (medians); "
          f"all completed: {all(r['completed'] for rs in rows.values() for r in rs)}")
    print(f"{'':24} {'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} {'TPOT p95':>9} {'e2e p50':>9} "
          f"{'out tok/s':>10} {'CPU/token':>10}")
    med = {name: {k: float(np.median([r[k] for r in rs])) for k in rs[0] if k != "completed"}
           for name, rs in rows.items()}
    for name, m in med.items():
        print(f"{name:24} {m['ttft_p50'] * 1e3:7.1f}ms {m['ttft_p95'] * 1e3:7.1f}ms {m['tpot_p50'] * 1e3:7.2f}ms "
              f"{m['tpot_p95'] * 1e3:7.2f}ms {m['e2e_p50']:8.2f}s {m['tok_per_s']:10.1f} "
              f"{m['cpu_ms_per_token']:8.2f}ms")
    a, b = med[names[0]], med[names[1]]
    ratios = [t["tpot_p50"] / i["tpot_p50"] for i, t in zip(rows[names[0]], rows[names[1]])]
    print(f"Triton / in-process: TPOT p50 x{float(np.median(ratios)):.3f} (pairs: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; target <= 1.05), TTFT p50 x{b['ttft_p50'] / a['ttft_p50']:.3f}, "
          f"e2e p50 x{b['e2e_p50'] / a['e2e_p50']:.3f}, "
          f"CPU per token x{b['cpu_ms_per_token'] / a['cpu_ms_per_token']:.3f} "
          "(server + stub + client vs this process)")
    print("CPU per token by process: " + "; ".join(
        f"{name}: " + ", ".join(f"{k.removeprefix('cpu_ms_per_token_')} {v:.2f} ms" for k, v in m.items()
                                 if k.startswith("cpu_ms_per_token_")) for name, m in med.items()))
    print(f"machine load (1-min average) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          "(shared: compare within one run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
