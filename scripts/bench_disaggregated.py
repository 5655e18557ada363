"""Disaggregated prefill/decode benchmark (not a test): a steady decode load plus bursts of long prompts, colocated
(one LLM on every core) against P prefill + D decode workers (``kiln.runtime.disagg``) on the same cores.

    .venv/bin/python scripts/bench_disaggregated.py [--seconds 40] [--steady 6] [--burst 3] [--burst-every 6]

The ~300M random Llama (``work/bench/llama-300m``, shared with the other benchmarks) is built into an int8
weight-only ``cpu`` engine (batch 16, prompts <= 512 tokens). Load, the same in both modes:

* steady: ``--steady`` requests always in flight (32-token prompts, ``--steady-tokens`` generated; each is replaced
  when it ends): their inter-token gaps are the TPOT that bursts hurt;
* bursts: every ``--burst-every`` s, ``--burst`` prompts of ``--burst-len`` tokens (8 generated).

Printed per mode: p50/p95 TPOT of the steady requests' inter-token gaps (as their client sees them), p95 TTFT of
steady and burst requests, generated tokens/s; for PD also the KV transfer (bytes, wire time, GB/s, the TTFT
split). Then the cost model: where PD pays (cores, prompt lengths), from the measured step times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

from bench_common import BENCH, ensure_checkpoint, ensure_engine, log

BUILD = dict(dtype="float32", quantization="int8_weight_only", backend="cpu", max_batch_size=16, max_input_len=512,
             max_seq_len=640, max_num_tokens=512, tokens_per_block=16)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class Load:
    """The steady + burst load against one LLM (anything with ``submit``); records what its client sees."""

    def __init__(self, llm, args, vocab: int):
        self.llm, self.args, self.vocab = llm, args, vocab
        self.rng = random.Random(29)
        self.gaps: list[float] = []            # steady requests' inter-token gaps
        self.ttft = {"steady": [], "burst": []}
        self.tokens = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.inflight = 0

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def submit(self, kind: str, n: int, max_tokens: int) -> None:
        from kiln.runtime import SamplingParams

        t0 = time.monotonic()
        last = [None]

        def cb(out) -> None:
            now = time.monotonic()
            with self.lock:
                got = len(out.delta_token_ids)
                self.tokens += got
                if got and last[0] is None:
                    self.ttft[kind].append(now - t0)
                elif got and kind == "steady":
                    self.gaps.extend([(now - last[0]) / got] * got)
                if got:
                    last[0] = now
                if out.finished:
                    self.inflight -= 1
            if out.finished and kind == "steady" and not self.stop.is_set():
                self.submit("steady", 32, self.args.steady_tokens)

        with self.lock:
            self.inflight += 1
        self.llm.submit(self.prompt(n), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        callback=cb)

    def run(self) -> dict:
        a = self.args
        for _ in range(a.steady):
            self.submit("steady", 32, a.steady_tokens)
        time.sleep(a.warmup)
        with self.lock:   # measure after the warm-up
            self.gaps.clear()
            self.ttft = {"steady": [], "burst": []}
            self.tokens = 0
        t0 = time.monotonic()
        next_burst = t0 + 1.0
        while time.monotonic() - t0 < a.seconds:
            if time.monotonic() >= next_burst:
                for _ in range(a.burst):
                    self.submit("burst", a.burst_len, 8)
                next_burst += a.burst_every
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        with self.lock:
            tokens = self.tokens
            gaps, ttft = list(self.gaps), {k: list(v) for k, v in self.ttft.items()}
        self.stop.set()
        deadline = time.monotonic() + 120
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"tpot_p50": pct(gaps, 50), "tpot_p95": pct(gaps, 95), "ttft_steady_p95": pct(ttft["steady"], 95),
                "ttft_burst_p95": pct(ttft["burst"], 95), "ttft_burst_p50": pct(ttft["burst"], 50),
                "tokens_per_s": tokens / elapsed, "gaps": len(gaps), "bursts": len(ttft["burst"])}


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def step_costs(llm) -> dict:
    """Colocated: mean decode-only step time, and the extra time per prefill token in mixed steps."""
    steps = list(llm.executor.metrics.steps)
    decode = [s.step_time for s in steps if s.prefill_tokens == 0 and s.decode_tokens]
    mixed = [(s.step_time, s.prefill_tokens) for s in steps if s.prefill_tokens >= 64]
    td = statistics.mean(decode) if decode else float("nan")
    per_tok = statistics.mean((t - td) / n for t, n in mixed) if mixed else float("nan")
    return {"decode_step": td, "prefill_per_token": per_tok, "decode_steps": len(decode), "mixed_steps": len(mixed)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--warmup", type=float, default=5)
    ap.add_argument("--steady", type=int, default=6)
    ap.add_argument("--steady-tokens", type=int, default=64)
    ap.add_argument("--burst", type=int, default=3)
    ap.add_argument("--burst-len", type=int, default=480)
    ap.add_argument("--burst-every", type=float, default=6)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--modes", default="colocated,pd")
    ap.add_argument("--out", type=Path, default=BENCH / "disaggregated.json")
    args = ap.parse_args()

    import torch

    from kiln.runtime import LLM
    from kiln.runtime.disagg import DisaggLLM

    engine = ensure_engine("llama-300m-int8-pd", BUILD, ensure_checkpoint())
    vocab = json.loads((engine / "config.json").read_text())["model"]["vocab_size"]
    results = {}
    for mode in args.modes.split(","):
        log(f"{mode}: starting")
        if mode == "colocated":
            torch.set_num_threads(args.threads)
            llm = LLM(engine, max_batch_size=16, max_kv_cache_tokens=16384)
        else:
            n = args.prefill_workers + args.decode_workers
            llm = DisaggLLM(engine, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                            worker_threads=max(1, args.threads // n), max_batch_size=16, max_kv_cache_tokens=16384)
        with llm:
            r = Load(llm, args, vocab).run()
            if mode == "colocated":
                r["costs"] = step_costs(llm)
            else:
                s = llm.stats()
                t = s["disagg"]["kv_transfer"]
                h = s["histograms"]
                r["transfer"] = {**t, "GB_per_s": t["bytes"] / t["seconds"] / 1e9 if t["seconds"] else None,
                                 "bytes_per_block": s["disagg"]["bytes_per_block"],
                                 "wire_p50": h["kv_transfer_time"]["p50"], "wire_p95": h["kv_transfer_time"]["p95"],
                                 "ttft_prefill_p50": h["ttft_prefill"]["p50"],
                                 "ttft_transfer_p50": h["ttft_transfer"]["p50"],
                                 "ttft_transfer_p95": h["ttft_transfer"]["p95"]}
                r["decode_step"] = s["counters"]["step_time"] / max(1, s["counters"]["steps"])
        results[mode] = r
        log(f"{mode}: TPOT p50 {ms(r['tpot_p50'])} p95 {ms(r['tpot_p95'])}; TTFT p95 steady "
            f"{ms(r['ttft_steady_p95'])} burst {ms(r['ttft_burst_p95'])}; {r['tokens_per_s']:.1f} tok/s")
        if "transfer" in r:
            t = r["transfer"]
            log(f"  KV transfer: {t['transfers']} requests, {t['blocks']} blocks x {t['bytes_per_block']} B = "
                f"{t['bytes'] / 2**20:.1f} MiB in {t['seconds']:.2f} s wire ({t['GB_per_s'] or 0:.2f} GB/s); wire p50 "
                f"{ms(t['wire_p50'])} p95 {ms(t['wire_p95'])}; TTFT split p50: prefill {ms(t['ttft_prefill_p50'])}, "
                f"transfer {ms(t['ttft_transfer_p50'])}")
    if "colocated" in results and "pd" in results:
        c, p = results["colocated"], results["pd"]
        log(f"p95 TPOT PD / colocated = {p['tpot_p95'] / c['tpot_p95']:.2f} (target <= 0.7); throughput PD / "
            f"colocated = {p['tokens_per_s'] / c['tokens_per_s']:.2f}")
        k = c["costs"]
        chunk = BUILD["max_num_tokens"]
        log(f"cost model inputs (colocated, {args.threads} threads): decode step {ms(k['decode_step'])}, prefill "
            f"{k['prefill_per_token'] * 1e6:.0f} us/token in mixed steps; PD workers' mean step (prefill and decode "
            f"steps together) {ms(p['decode_step'])} on {max(1, args.threads // 2)} thread(s) each")
        worst = k["decode_step"] + min(chunk, args.burst_len) * k["prefill_per_token"]
        # a burst's prompts are chunked into steps of <= max_num_tokens: each one a gap of decode + chunk prefill
        hit = args.burst * args.burst_len / chunk / (args.burst_every / k["decode_step"])
        # the decode worker's step ~ its client's median gap (steady requests only reach it)
        need = (p["tpot_p50"] / 0.7 - k["decode_step"]) / k["prefill_per_token"]
        log(f"  colocated gap with one {min(chunk, args.burst_len)}-token prefill chunk = {ms(worst)}; share of decode "
            f"steps carrying a chunk ~ {hit:.1%} (p95 needs > 5%); PD reaches 0.7x when the chunk's prefill "
            f"exceeds decode_step_PD / 0.7 - decode_step, i.e. chunks of >= {need:.0f} tokens (and bursts dense "
            "enough to reach the p95)")
        r_model = {"colocated_gap_with_chunk": worst, "burst_step_share": hit, "break_even_chunk_tokens": need}
        results["cost_model"] = r_model
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
