"""Replay a serving run's arrivals through kiln's own Scheduler on a virtual clock, and sweep its knobs (not a test).

    .venv/bin/python scripts/serving_model.py OUT_DIR [--kiln kiln] [--peer vllm] [--step 0.0125,0.0011]
                                              [--budgets 128,256,384] [--leads 0,1,2] [--backlog-budgets 384]

OUT_DIR is a ``kiln bench ... compare`` output directory: each target's ``result.json`` holds its runs' per-request
records (when each request was sent, its prompt and output lengths, its TTFT and TPOT). The model takes one
target's arrivals (``--kiln``), feeds them to ``kiln.runtime.scheduler.Scheduler`` with the engine's bounds from
that result, and advances a virtual clock by each step's time: ``a + b x tokens`` (``--step a,b``: the fit ``kiln
serve --schedule-from-step-time`` logs at startup is a start; that fit averages attention in) plus the decode rows'
attention (``--decode-attention`` s per row x context position) and the prefill chunks' attention
(``--prefill-attention`` s per new token x position). The defaults fit bf16-64x2048 on Zen 4 (session 20, see
docs/benchmarks.md): ``--check`` shows the fit on another machine or engine.
Every request decodes its recorded output length. It prints, per policy, the model's TTFT p50 / p95 and TPOT p95 at
each rate as ratios to what the peer (``--peer``) measured in the same run, and marks the policies under
``--target`` (0.8: issue 30's serving target) on all three at every rate.

Policies: every ``decoding_max_num_tokens`` of ``--budgets`` with every ``short_prompt_lead_s`` of ``--leads``
(the executor's knobs, as the scheduler implements them), and, for each budget of ``--backlog-budgets``, the same
with that larger budget while more than ``--backlog`` prompt tokens wait to be prefilled (a policy the executor
does not have: what clearing a burst with longer steps would buy). ``--check BUDGET,LEAD`` prints the model next
to the kiln target's own measurement first, for a server run with those knobs: how far to trust the rest.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

from kiln.runtime.kv_cache import KVCacheManager
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler, SchedulerConfig

Arrival = tuple[float, int, int]   # (seconds after the run's start, prompt tokens, output tokens)


def quantile(xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default), as kiln bench reports."""
    xs = sorted(xs)
    k = q * (len(xs) - 1)
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def load_runs(result: Path) -> tuple[dict, list[dict]]:
    """(the engine's bounds, the runs: rate, arrivals sorted by time, measured TTFTs and TPOTs) of a result.json."""
    data = json.loads(result.read_text())
    runs = []
    for run in data["runs"]:
        recs = run["per_request"]
        runs.append(dict(rate=run["rate"],
                         arrivals=sorted((r["sent"], r["prompt_len"], r["output_len"]) for r in recs),
                         ttft=[r["ttft"] for r in recs if r.get("ttft") is not None],
                         tpot=[r["tpot"] for r in recs if r.get("tpot") is not None]))
    return data["engine"]["bounds"], runs


def replay(arrivals: list[Arrival], bounds: dict, step: tuple[float, float], decode_attention: float,
           prefill_attention: float, budget: int, lead: float, backlog_budget: int | None = None,
           backlog: int = 1024) -> tuple[list[float], list[float]]:
    """TTFTs and TPOTs (seconds; TPOT of requests of 2+ output tokens) of ``arrivals`` under the knobs."""
    a, b = step
    config = SchedulerConfig(max_batch_size=bounds["max_batch_size"], max_num_tokens=bounds["max_num_tokens"],
                             max_seq_len=bounds["max_seq_len"], max_input_len=bounds["max_input_len"],
                             max_num_logits=bounds.get("max_num_logits"), decoding_max_num_tokens=budget,
                             short_prompt_lead_s=lead)
    blocks = 2 * len(arrivals) * (bounds["max_seq_len"] // bounds["tokens_per_block"] + 1)
    sched = Scheduler(config, KVCacheManager(blocks, bounds["tokens_per_block"], enable_prefix_reuse=False))
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    seq = itertools.count()
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    now, nxt = 0.0, 0
    while nxt < len(arrivals) or sched.has_unfinished():
        while nxt < len(arrivals) and arrivals[nxt][0] <= now:
            sent, prompt, output = arrivals[nxt]
            sched.add_request(Request(str(nxt), [1] * prompt, params, output, arrival_time=sent, seq=next(seq)))
            nxt += 1
        if not sched.has_unfinished():
            now = arrivals[nxt][0]
            continue
        if backlog_budget is not None:
            waiting = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting + sched.running
                          if r.num_tokens - r.num_computed_tokens > 1)
            config.decoding_max_num_tokens = backlog_budget if waiting > backlog else budget
        out = sched.schedule()
        decode_ctx = sum(s.start for s in out.scheduled if s.num_new_tokens == 1)
        prefill_pairs = sum(s.num_new_tokens * (s.start + s.num_new_tokens / 2)
                            for s in out.scheduled if s.num_new_tokens > 1)
        now += a + b * out.num_tokens + decode_attention * decode_ctx + prefill_attention * prefill_pairs
        sampled = {i: 1 for i, s in enumerate(out.scheduled) if s.samples}
        for req, _ in sched.update_from_output(out, sampled):
            k = int(req.request_id)
            first.setdefault(k, now)
            last[k] = now
            if req.num_output_tokens >= req.max_tokens:
                sched.finish_requests(req.request_id, RequestStatus.FINISHED_LENGTH)
    ttft = [first[k] - arrivals[k][0] for k in range(len(arrivals))]
    tpot = [(last[k] - first[k]) / (arrivals[k][2] - 1) for k in range(len(arrivals)) if arrivals[k][2] > 1]
    return ttft, tpot


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--kiln", default="kiln", help="the target whose arrivals and engine bounds are replayed")
    ap.add_argument("--peer", default="vllm", help="the target whose measurements the model is compared with")
    ap.add_argument("--step", default="0.0125,0.0011", help="a,b: a step's seconds = a + b x tokens")
    ap.add_argument("--decode-attention", type=float, default=3.6e-6, help="s per decode row x context position")
    ap.add_argument("--prefill-attention", type=float, default=1.6e-7, help="s per new token x context position")
    ap.add_argument("--budgets", default="128,192,256,384,2048")
    ap.add_argument("--leads", default="0,1,2,4")
    ap.add_argument("--backlog-budgets", default="256,384,512")
    ap.add_argument("--backlog", type=int, default=1024, help="prompt tokens waiting that switch to the larger budget")
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--check", default=None, help="BUDGET,LEAD of the kiln target's server: model vs measured")
    args = ap.parse_args()
    step = tuple(float(x) for x in args.step.split(","))
    bounds, runs = load_runs(args.out_dir / args.kiln / "result.json")
    _, peer = load_runs(args.out_dir / args.peer / "result.json")
    rates = " / ".join(f"{r['rate']:g}" for r in runs)
    model = dict(step=step, decode_attention=args.decode_attention, prefill_attention=args.prefill_attention)
    if args.check:
        budget, lead = args.check.split(",")
        print(f"{args.kiln} measured against the model of its knobs (budget {budget}, lead {lead} s), rates {rates}:")
        for run in runs:
            ttft, tpot = replay(run["arrivals"], bounds, budget=int(budget), lead=float(lead), **model)
            print(f"  {run['rate']:g} req/s: TTFT p50 {quantile(run['ttft'], .5):.2f} / {quantile(ttft, .5):.2f} s, "
                  f"p95 {quantile(run['ttft'], .95):.2f} / {quantile(ttft, .95):.2f} s, TPOT p95 "
                  f"{1e3 * quantile(run['tpot'], .95):.0f} / {1e3 * quantile(tpot, .95):.0f} ms")
    print(f"model / {args.peer} measured, rates {rates} req/s ('<=' marks every ratio <= {args.target}):")
    policies = [(b, lead, None) for b in ints(args.budgets) for lead in (float(x) for x in args.leads.split(","))]
    policies += [(ints(args.budgets)[0], lead, hi) for hi in ints(args.backlog_budgets)
                 for lead in (float(x) for x in args.leads.split(","))]
    for budget, lead, hi in policies:
        cols = {"TTFT p50": [], "TTFT p95": [], "TPOT p95": []}
        tpot_ms = []
        for run, ref in zip(runs, peer):
            ttft, tpot = replay(run["arrivals"], bounds, budget=budget, lead=lead, backlog_budget=hi,
                                backlog=args.backlog, **model)
            cols["TTFT p50"].append(quantile(ttft, .5) / quantile(ref["ttft"], .5))
            cols["TTFT p95"].append(quantile(ttft, .95) / quantile(ref["ttft"], .95))
            cols["TPOT p95"].append(quantile(tpot, .95) / quantile(ref["tpot"], .95))
            tpot_ms.append(1e3 * quantile(tpot, .95))
        name = f"budget {budget}" + (f" ({hi} past {args.backlog} waiting)" if hi else "") + f", lead {lead:g} s"
        ok = all(x <= args.target for xs in cols.values() for x in xs)
        print(f"  {name:40s} " + "  ".join(f"{k} " + " ".join(f"{x:.2f}" for x in v) for k, v in cols.items())
              + f"  (TPOT p95 ms {' '.join(f'{x:.0f}' for x in tpot_ms)})" + ("  <=" if ok else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
