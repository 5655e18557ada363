"""Serving benchmark (not a test): kiln's in-flight batching vs transformers static batches on one workload.

    .venv/bin/python scripts/bench_serving.py [--rate 0.8] [--dtype float32] [--requests 64]

A ~300M-parameter random Llama (``work/bench/llama-300m``, created once, shared with the builder bench) is
built into an engine; 64 requests (prompt 32-512 tokens, output 16-256 tokens, fixed by --seed) arrive as a
Poisson process at --rate requests/s. kiln serves them as they arrive. transformers serves the same requests
in arrival order as static batches of 16 (``generate``, left-padded; a batch starts when its 16th request has
arrived and the previous batch is done, and all of its requests end when its longest one does); its timeline
is computed from the measured duration of each batch, so no wall time is spent idling.

Prints request throughput, output tokens/s, TTFT and TPOT p50/p95 for both, the ratios, and the step loop's
own overhead (step time minus engine.run) as a share of step time at batch 16.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import torch

from bench_common import BENCH, CKPT, engine_is_current, ensure_checkpoint, log  # noqa: E402


def ensure_engine(dtype: str, max_batch_size: int, max_num_tokens: int, backend: str) -> Path:
    from kiln.builder import BuildConfig, build_engine

    build = dict(dtype=dtype, max_batch_size=max_batch_size, max_input_len=512, max_seq_len=768,
                 max_num_tokens=max_num_tokens, tokens_per_block=16, backend=backend)
    suffix = "" if backend == "cpu" else f"-{backend}"
    out = BENCH / f"engine-serving-{dtype}-b{max_batch_size}-t{max_num_tokens}{suffix}"
    if engine_is_current(out, build):
        log(f"reusing engine {out}")
        return out
    log(f"building a {dtype} engine into {out} ...")
    t0 = time.perf_counter()
    build_engine(CKPT, out, BuildConfig(**build), progress=lambda stage, msg: log(f"  build {stage}: {msg}"))
    log(f"engine built in {time.perf_counter() - t0:.1f} s")
    return out


def make_workload(n: int, rate: float, seed: int, vocab: int, prompt_len=(32, 512), output_len=(16, 256)):
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))]
        reqs.append(dict(id=i, arrival=t, prompt=prompt, max_tokens=rng.randint(*output_len)))
    return reqs


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(name: str, rows: list[dict], span: float) -> dict:
    out_tokens = sum(r["tokens"] for r in rows)
    s = dict(name=name, span=span, req_per_s=len(rows) / span, out_tok_per_s=out_tokens / span,
             ttft_p50=pct([r["ttft"] for r in rows], 50), ttft_p95=pct([r["ttft"] for r in rows], 95),
             tpot_p50=pct([r["tpot"] for r in rows if r["tpot"] is not None], 50),
             tpot_p95=pct([r["tpot"] for r in rows if r["tpot"] is not None], 95),
             e2e_p50=pct([r["e2e"] for r in rows], 50))
    return s


def run_kiln(engine_dir: Path, workload: list[dict], args) -> tuple[dict, dict]:
    from kiln.runtime import LLM, SamplingParams

    llm = LLM(engine_dir, max_batch_size=args.max_batch_size, capacity_policy=args.capacity_policy,
              max_kv_cache_tokens=args.max_kv_cache_tokens)
    log(llm.executor.kv_plan)
    # warm-up (first calls of an exported program are slower); then reset the metrics
    llm.generate([[5] * 64, [6] * 8], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    from kiln.runtime.metrics import RuntimeMetrics

    llm.executor.metrics = RuntimeMetrics()
    done = threading.Event()
    results: dict[int, object] = {}
    lock = threading.Lock()

    def cb_for(i):
        def cb(out):
            if out.finished:
                with lock:
                    results[i] = out
                    if len(results) == len(workload):
                        done.set()
        return cb

    t0 = time.monotonic()

    def submitter():
        for r in workload:
            delay = t0 + r["arrival"] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            llm.executor.submit(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True),
                                callback=cb_for(r["id"]), arrival_time=t0 + r["arrival"])

    threading.Thread(target=submitter, daemon=True).start()
    while not done.wait(10):
        st = llm.stats()
        g, c = st["gauges"], st["counters"]
        elapsed = time.monotonic() - t0
        log(f"  kiln t={elapsed:5.0f}s finished {len(results)}/{len(workload)} running {g['running']} "
            f"waiting {g['waiting']} generated {c['generation_tokens']} ({c['generation_tokens'] / elapsed:.0f} tok/s) "
            f"KV {g['kv_usage']:.0%}")
    end = max(o.metrics.finished_time for o in results.values())
    rows = [dict(tokens=len(o.token_ids), ttft=o.metrics.ttft, tpot=o.metrics.mean_tpot, e2e=o.metrics.e2e_latency)
            for o in results.values()]
    assert all(len(results[r["id"]].token_ids) == r["max_tokens"] for r in workload)
    steps = list(llm.executor.metrics.steps)
    stats = llm.stats()
    llm.shutdown()
    return summarize("kiln (in-flight batching)", rows, end - t0), dict(steps=steps, stats=stats)


def run_hf_static(workload: list[dict], dtype: str, batch: int) -> dict:
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(CKPT, dtype=getattr(torch, dtype)).eval()

    class FirstToken(LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.monotonic()
            return scores

    warm = torch.tensor([[5] * 16])
    with torch.no_grad():
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False, pad_token_id=0)
    rows, clock = [], 0.0
    for b in range(0, len(workload), batch):
        group = workload[b:b + batch]
        width = max(len(r["prompt"]) for r in group)
        ids = torch.tensor([[0] * (width - len(r["prompt"])) + r["prompt"] for r in group])
        mask = torch.tensor([[0] * (width - len(r["prompt"])) + [1] * len(r["prompt"]) for r in group])
        new = max(r["max_tokens"] for r in group)
        first = FirstToken()
        t0 = time.monotonic()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0, logits_processor=LogitsProcessorList([first]))
        t1 = time.monotonic()
        assert out.shape[1] == width + new
        start = max(clock, max(r["arrival"] for r in group))     # waits for its 16th request and the previous batch
        ttft_at = start + (first.t - t0)
        end = start + (t1 - t0)
        tpot = (t1 - first.t) / max(new - 1, 1)
        for r in group:
            rows.append(dict(tokens=r["max_tokens"], ttft=ttft_at - r["arrival"], tpot=tpot, e2e=end - r["arrival"]))
        clock = end
        log(f"  transformers batch {b // batch + 1}/{-(-len(workload) // batch)}: {len(group)} x prompt<={width} "
            f"-> {new} new tokens in {t1 - t0:.1f} s (prefill {first.t - t0:.1f} s)")
    return summarize(f"transformers static batches of {batch}", rows, clock - 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cpu-compiled"],
                    help="engine backend (cpu-compiled: AOTInductor, a few minutes of compile on first use)")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--max-num-tokens", type=int, default=256)
    ap.add_argument("--max-kv-cache-tokens", type=int, default=None)
    ap.add_argument("--capacity-policy", default="max_utilization", choices=["guaranteed_no_evict", "max_utilization"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true", help="only run kiln")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    ensure_checkpoint()
    engine_dir = ensure_engine(args.dtype, args.max_batch_size, args.max_num_tokens, args.backend)
    vocab = json.loads((CKPT / "config.json").read_text())["vocab_size"]
    workload = make_workload(args.requests, args.rate, args.seed, vocab, args.prompt_len, args.output_len)
    n_prompt = sum(len(r["prompt"]) for r in workload)
    n_out = sum(r["max_tokens"] for r in workload)
    log(f"workload: {len(workload)} requests, Poisson arrivals at {args.rate} req/s (last at "
        f"{workload[-1]['arrival']:.1f} s), {n_prompt} prompt tokens, {n_out} output tokens, dtype {args.dtype}, "
        f"{args.threads} threads")

    import os

    load = {}
    log("kiln: serving the workload as it arrives ...")
    load["kiln"] = [os.getloadavg()[0]]
    kiln, extra = run_kiln(engine_dir, workload, args)
    load["kiln"].append(os.getloadavg()[0])
    results = [kiln]
    if not args.skip_hf:
        log("transformers: the same requests as static batches of 16 ...")
        load["hf"] = [os.getloadavg()[0]]
        results.append(run_hf_static(workload, args.dtype, 16))
        load["hf"].append(os.getloadavg()[0])

    print()
    print(f"workload: {len(workload)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, outputs "
          f"{args.output_len[0]}-{args.output_len[1]}, Poisson {args.rate} req/s, "
          f"seed {args.seed}, {args.dtype}, kiln backend {args.backend}, {args.threads} threads")
    print(f"{'':40} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} {'TPOT p95':>9} "
          f"{'e2e p50':>8} {'span':>7}")
    for r in results:
        print(f"{r['name']:40} {r['req_per_s']:7.3f} {r['out_tok_per_s']:10.1f} {r['ttft_p50']:8.2f}s "
              f"{r['ttft_p95']:8.2f}s {r['tpot_p50'] * 1e3:7.1f}ms {r['tpot_p95'] * 1e3:7.1f}ms "
              f"{r['e2e_p50']:7.1f}s {r['span']:6.1f}s")
    if len(results) == 2:
        k, h = results
        print(f"kiln / transformers: output tokens/s x{k['out_tok_per_s'] / h['out_tok_per_s']:.2f} (target >= 2), "
              f"p95 TTFT x{k['ttft_p95'] / h['ttft_p95']:.2f} (target <= 0.5)")
    steps = extra["steps"]
    for label, sel in ((f"batch {args.max_batch_size}", [s for s in steps if s.batch_size == args.max_batch_size]),
                       ("batch 16 decode-only", [s for s in steps if s.batch_size == 16 and s.prefill_tokens == 0]),
                       ("all steps", steps)):
        if sel:
            st = sum(s.step_time for s in sel)
            ov = sum(s.overhead for s in sel)
            print(f"step loop overhead ({label}, {len(sel)} steps): {ov / st:.2%} of step time "
                  f"(mean step {st / len(sel) * 1e3:.1f} ms, of which engine.run {(st - ov) / len(sel) * 1e3:.1f} ms)")
    print("machine load (1-min load average at start / end; the machine is shared, compare within one run): "
          + ", ".join(f"{k} {a:.1f} / {b:.1f}" for k, (a, b) in load.items()))
    c = extra["stats"]["counters"]
    print(f"kiln: {c['steps']} steps, {c['preemptions']} preemptions, mean batch "
          f"{extra['stats']['histograms']['batch_size']['mean']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
