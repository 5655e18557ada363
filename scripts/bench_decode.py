"""Single-stream decode against the read rate, and where a decode step's time goes (not a test).

    .venv/bin/python scripts/bench_decode.py ENGINE_DIR [ENGINE_DIR ...] [--rounds 3] [--tokens 64] [--profile]

Each round runs every engine once (alternating, one ``LLM`` per engine loaded for the whole run) like
``../shared/peers/bench_kiln.py single``: a 128-token prompt, greedy, EOS ignored, decode tok/s = (tokens - 1) /
(time of the whole request - time of prefill + 1 token). A 256 MiB streaming read right before and after each run
gives the read rate of that moment; the share of it = tok/s x bytes a decode token streams (the memory plan's
``decode_read_bytes``: every weight but the rows gathered from an untied embedding table) / read rate.

Breakdown, per decode step of the timed requests (median over the steps, ms), from timers wrapped around the
executor's parts: schedule, pack (the contract inputs), engine.run, sample, update (the scheduler's books), emit
(detokenize, stop rules, the output callback), record (metrics); "loop" is the rest of the time between two steps
(the step loop, its lock, the thread handoff). ``--profile`` also splits ``engine.run`` itself with
torch.profiler over decode steps of the engine alone (context 128): the kiln ops by kind (linear = the GEMVs and the
LM head), other torch ops, and "graph" = engine.run minus those ops (the compiled graph's own kernels, the calls
into the ops, the input checks); ``linear GB/s`` is the bytes streamed per step / the time in the linears.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench_common import decode_step_times, log

PARTS = ("schedule", "pack", "engine", "sample", "update", "emit", "record", "loop")
OP_KINDS = {"weight_only_linear": "linear", "bf16_linear": "linear", "fp32_linear": "linear",
            "paged_attention": "attention", "rms_norm": "norm", "fused_add_rms_norm": "norm",
            "rotary_embedding": "rope", "silu_mul": "silu_mul", "gelu": "silu_mul"}


def streamed_bytes(engine) -> int:
    """Weights bytes one decode token reads: the builder's memory plan (every weight but the rows that lookups gather
    from the embedding table: a tied table is the LM head, streamed whole; a quantized engine's table is gathered)."""
    return engine.config.memory.decode_read_bytes


class StepTimers:
    """Seconds of each executor part per step, from wrappers put on one executor's instance attributes."""

    def __init__(self, executor) -> None:
        self.steps: list[dict[str, float]] = []
        self._cur: dict[str, float] = defaultdict(float)
        self._last_end: float | None = None
        ex = executor
        ex.scheduler.schedule = self._timed("schedule", ex.scheduler.schedule, first=True)
        ex._pack = self._timed("pack", ex._pack)
        ex.engine.run = self._timed("engine", ex.engine.run)
        ex.sampler = _Timed(self, ex.sampler)
        ex.scheduler.update_from_output = self._timed("update", ex.scheduler.update_from_output)
        ex._emit_outputs = self._timed("emit", ex._emit_outputs)
        ex._record_step = self._timed("record", ex._record_step, last=True)

    def _timed(self, name: str, fn, first: bool = False, last: bool = False):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            if first:
                self._cur = defaultdict(float)
                self._cur["start"] = t0
                self._cur["since_last"] = t0 - self._last_end if self._last_end is not None else 0.0
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self._cur[name] += t1 - t0
                if last:
                    self._cur["total"] = t1 - self._cur["start"]
                    self._last_end = t1
                    self.steps.append(dict(self._cur))
        return wrapper

    def reset(self) -> None:
        self.steps = []
        self._last_end = None


class _Timed:
    """The sampler with its calls timed (the executor calls it, and may use its other attributes)."""

    def __init__(self, timers: StepTimers, sampler) -> None:
        self._sampler = sampler
        self._call = timers._timed("sample", sampler.__call__)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sampler, name)


def decode_breakdown(steps: list[dict[str, float]]) -> dict[str, float]:
    """ms per part, median over the decode steps (the first step, the prefill, is left out); "loop" is the
    median time between one step's end and the next one's start."""
    dec = steps[1:]
    out = {p: 1e3 * statistics.median(s.get(p, 0.0) for s in dec) for p in PARTS if p != "loop"}
    out["loop"] = 1e3 * statistics.median(s["since_last"] for s in dec[1:]) if len(dec) > 1 else 0.0
    out["step"] = 1e3 * statistics.median(s["total"] for s in dec)
    out["per token"] = out["step"] + out["loop"]
    return out


def profile_engine(engine, steps: int = 20) -> dict[str, float]:
    """ms per decode step (context 128, engine.run alone) by op kind, and "graph" = the rest of engine.run."""
    from torch.profiler import ProfilerActivity, profile

    decode_step_times(engine, 1, 3)
    plain = statistics.median(decode_step_times(engine, 1, steps))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = statistics.median(decode_step_times(engine, 1, steps))
    out: dict[str, float] = defaultdict(float)
    top = [ev for ev in prof.events() if ev.cpu_parent is None]
    # the prefill step and the steps' own bookkeeping are in the trace too: count kiln ops per decode step by
    # taking the events of the last `steps` engine runs (each step's ops in one contiguous run of events)
    per_step = len([ev for ev in top if ev.name.startswith("kiln::")]) // (steps + 1)
    kiln_ops = [ev for ev in top if ev.name.startswith("kiln::")][-per_step * steps:]
    for ev in kiln_ops:
        out[OP_KINDS.get(ev.name.removeprefix("kiln::"), ev.name)] += ev.cpu_time_total / 1e3 / steps
    first_us = kiln_ops[0].time_range.start if kiln_ops else 0
    for ev in top:
        if not ev.name.startswith("kiln::") and ev.time_range.start >= first_us and not ev.name.startswith(
                ("ProfilerStep", "aten::randint", "aten::lift")):
            out["other torch ops"] += ev.cpu_time_total / 1e3 / steps
    ops = sum(out.values())
    out["graph"] = 1e3 * wall - ops
    out["engine.run"] = 1e3 * plain
    out["engine.run (profiled)"] = 1e3 * wall
    out["ops per step"] = per_step
    if out.get("linear"):
        out["linear GB/s"] = streamed_bytes(engine) / (out["linear"] / 1e3) / 1e9
    return dict(out)


def single_request(llm, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(seconds of prefill + 1 token, seconds of the whole request of ``tokens`` tokens), greedy."""
    from kiln.runtime import SamplingParams

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        dt = time.perf_counter() - t0
        assert len(out[0].token_ids) == n, (len(out[0].token_ids), n, out[0].finish_reason)
        return dt
    first = min(gen(1), gen(1))
    return first, gen(tokens)


def child(engine_dir: Path, tokens: int, profile: bool) -> dict:
    """One run in this process: the single-stream request (or, ``profile``, engine.run alone), as a dict."""
    if profile:   # the engine alone on this thread (no LLM: its step loop's thread would be a second OpenMP team)
        from kiln.runtime import Engine

        engine = Engine.from_dir(engine_dir)
        return profile_engine(engine)
    from kiln.runtime import LLM

    llm = LLM(str(engine_dir), max_batch_size=16, max_kv_cache_tokens=256, enable_prefix_reuse=False)
    timers = StepTimers(llm.executor)
    vocab = llm.executor.engine.config.model.vocab_size
    prompt = [random.Random(0).randrange(3, vocab) for _ in range(128)]
    single_request(llm, prompt, 8)   # warm-up
    timers.reset()
    first, total = single_request(llm, prompt, tokens)
    out = {"tok_s": (tokens - 1) / (total - first), "streamed": streamed_bytes(llm.executor.engine),
           "parts": decode_breakdown(timers.steps[-tokens:])}
    llm.executor.close()
    return out


def read_rate(python: str) -> float:
    """GB/s of a 256 MiB 2-thread streaming read, best of 3, in a process of its own (an OpenMP team in this
    process's main thread would make libgomp stop spinning in the measured process's step loop: see
    kiln.runtime.executor)."""
    scripts = str(Path(__file__).resolve().parent)
    code = (f"import sys; sys.path.insert(0, {scripts!r}); from bench_common import stream_read_bandwidth as b; "
            "print(b(256 << 20, 3, 2))")
    return float(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])


def run_child(python: str, engine: Path, args, profile: bool = False, env: dict | None = None) -> dict:
    cmd = [python, __file__, str(engine), "--child", "--tokens", str(args.tokens), "--threads", str(args.threads)]
    proc = subprocess.run(cmd + (["--profile"] if profile else []), capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{engine}: the run failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(lines[-1][7:])


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """"label:NAME=VALUE,NAME=VALUE" -> (label, environment additions)."""
    label, _, env = spec.partition(":")
    pairs = [kv.split("=", 1) for kv in env.split(",") if kv]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--variants {spec!r}: write label:NAME=VALUE[,NAME=VALUE]")
    return label, dict(pairs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("THREADS", "2")))
    ap.add_argument("--profile", action="store_true", help="also split engine.run by op kind (torch.profiler)")
    ap.add_argument("--variants", default="",
                    help="semicolon-separated label:NAME=VALUE,... environments each engine also runs under "
                         "(A/B in the same rounds), e.g. 'spin0:GOMP_SPINCOUNT=0'")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print("RESULT " + json.dumps(child(args.engines[0], args.tokens, args.profile)), flush=True)
        return 0
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    log(f"cpu: {cpu}, {args.threads} threads, torch {torch.__version__}; one process per run")
    variants = [("", {})] + [parse_variant(v) for v in args.variants.split(";") if v]
    runs = [(f"{e.name}{' ' + label if label else ''}", e, env) for e in args.engines for label, env in variants]
    results: dict[str, list[tuple[float, float, dict]]] = defaultdict(list)
    after = read_rate(sys.executable)
    for r in range(args.rounds):
        for name, engine, env in runs:
            before = after
            res = run_child(sys.executable, engine, args, env=env)
            after = read_rate(sys.executable)
            rate = (before + after) / 2
            share = res["tok_s"] * res["streamed"] / 1e9 / rate
            parts = res["parts"]
            results[name].append((res["tok_s"], share, parts))
            print(f"round {r + 1} {name:32} {res['tok_s']:7.1f} tok/s  read {rate:5.1f} GB/s  {100 * share:4.0f}% of "
                  f"it  per token {parts['per token']:.2f} ms (engine.run {parts['engine']:.2f})", flush=True)
    print("\nmedians over rounds; per decode step, ms (median of the steps of each run, then over rounds)")
    cols = (*PARTS, "per token")
    print(f"{'run':32} {'tok/s':>7} {'% read':>6} " + " ".join(f"{p:>8}" for p in cols))
    for name, rows in results.items():
        med = {p: statistics.median(row[2][p] for row in rows) for p in cols}
        print(f"{name:32} {statistics.median(r[0] for r in rows):7.1f} "
              f"{100 * statistics.median(r[1] for r in rows):5.0f}% " + " ".join(f"{med[p]:8.3f}" for p in cols))
    if args.profile:
        print("\nengine.run alone, batch 1, context 128, ms per step (torch.profiler; 'graph' = the rest)")
        for name, engine, env in runs:
            prof = run_child(sys.executable, engine, args, profile=True, env=env)
            print(f"{name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in sorted(prof.items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
