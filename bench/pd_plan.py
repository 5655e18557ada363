"""``kiln plan --pd``: how many prefill and how many decode workers (``kiln serve --prefill-workers P
--decode-workers D``) serve a workload at a rate within an SLO, against colocated engines on the same hardware.

Every worker is one engine on an equal share of the hardware, so P + D workers compare with N = P + D colocated
instances. The costs are the planner's step-time fit (``planner.plan``: roofline or ``--calibration``):
t_step = fixed + token x tokens + sequence x sampled sequences + context x KV tokens read.

Prefill worker (rate r_p = rate / P): a prompt of p tokens takes S(p) = ceil(p / max_num_tokens) x fixed +
p x token + attention x p^2 / 2 + sequence (its chunks alone in their steps: conservative, a busy worker packs
prompts into shared steps); the queue before it is M/G/1 (Pollaczek-Khinchine):
W = r_p E[S^2] / (2 (1 - r_p E[S])).
KV transfer: X(p) = ceil(p / tokens_per_block) x bytes per block / transport bandwidth (both measured: ``kiln bench``
against a PD server reports them, ``bench/disagg.py``); it overlaps the next prefill, so it adds to TTFT only.
Decode worker (rate r_d = rate / D): its steps carry decodes only, each costing k = token + sequence + context x
(mean prompt + output / 2), so t_step = fixed / (1 - r_d x output x k) (Little's law: r_d x output x t_step decodes
per step); TPOT = t_step; the sequences it holds, r_d x output x t_step, must fit its seats (the planner's queueing
concurrency).
TTFT(p95 prompt) = W + S(p95) + X(p95) + t_step / 2 (the decode worker admits the request at its next step).
Colocated instances: the planner's own load model at rate / N (``plan``'s TTFT and TPOT).
These are mean values: they show where PD pays on average (decode steps free of prefill tokens, prefill free of
decodes) and what it costs (the transfer, and workers idle in one role while the other queues); the tail of
TPOT under bursts of long prompts, where PD pays most, is the benchmark's to measure
(scripts/bench_disaggregated.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.bench.planner import PlanError, WorkloadStats


@dataclass(frozen=True)
class StepModel:
    """One engine's step-time fit (seconds): see the module docstring."""

    fixed_s: float       # per step: the weights streamed
    token_s: float       # per token computed: GEMMs (+ tensor-parallel all-reduce)
    sequence_s: float    # per sampled sequence: the LM head (+ logits gather)
    context_s: float     # per KV token a decode reads: its bytes / bandwidth + attention FLOPs
    attention_s: float   # per (query, key) pair of a prompt's causal attention
    chunk: int           # max_num_tokens: a prompt's prefill chunk
    block: int           # tokens per KV block
    seats: float         # sequences one engine runs at once before queueing (planner: queueing_concurrency)

    def prefill_s(self, prompt: float) -> float:
        return (math.ceil(prompt / self.chunk) * self.fixed_s + prompt * self.token_s
                + self.attention_s * prompt * prompt / 2 + self.sequence_s)


@dataclass(frozen=True)
class Transport:
    """The KV transfer: bytes per block and the transport's bandwidth (bytes/s), each with where it came from."""

    bytes_per_block: float
    bandwidth: float
    source: str

    def seconds(self, prompt: float, block: int) -> float:
        return math.ceil(prompt / block) * self.bytes_per_block / self.bandwidth


def transport_from_result(path: Path, bytes_per_block: float | None) -> Transport:
    """The transport measured by ``kiln bench`` against a PD server (``runs[*].disagg``): bandwidth = bytes moved /
    wire time summed over the rates; bytes per block = bytes / blocks (or ``bytes_per_block`` when the result
    moved none)."""
    from kiln.bench.report import read_result

    runs = [r["disagg"] for r in read_result(path).get("runs", []) if r.get("disagg")]
    moved = sum(d["kv_transfer_bytes"] for d in runs)
    wire = sum(d["transfer_time_s"]["mean"] * d["transfer_time_s"]["count"] for d in runs
               if d["transfer_time_s"]["mean"] is not None)
    if not moved or wire <= 0:
        raise PlanError(f"{path}: no KV transfers measured (run kiln bench against kiln serve --prefill-workers "
                        "--decode-workers, or give --transfer-bandwidth)")
    blocks = sum(d["kv_transfer_blocks"] for d in runs)
    per_block = moved / blocks if blocks else bytes_per_block
    return Transport(per_block, moved / wire, f"measured by kiln bench ({path}): {moved / 1e6:.1f} MB in "
                                              f"{wire * 1e3:.1f} ms of wire time, {blocks:.0f} blocks")


@dataclass(frozen=True)
class Config:
    """One candidate: P prefill + D decode workers (``colocated``: N = P + D instances, prefill = decode = 0)."""

    prefill: int
    decode: int
    colocated: bool
    ttft_s: float            # of the p95 prompt
    tpot_s: float
    prefill_util: float | None
    decode_util: float | None
    decode_seqs: float | None  # sequences one decode worker holds (Little's law), against its seats
    transfer_s: float | None  # of the p95 prompt
    meets: bool

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def row(self) -> dict:
        return {"config": f"colocated x{self.workers}" if self.colocated else f"P={self.prefill} D={self.decode}",
                "workers": self.workers, "ttft_p95_s": self.ttft_s, "tpot_s": self.tpot_s,
                "prefill_util": self.prefill_util, "decode_util": self.decode_util, "decode_seqs": self.decode_seqs,
                "transfer_p95_s": self.transfer_s,
                "meets_slo": self.meets}


def _meets(ttft: float, tpot: float, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    return (math.isfinite(ttft) and math.isfinite(tpot) and (slo_ttft is None or ttft <= slo_ttft)
            and (slo_tpot is None or tpot <= slo_tpot))


def pd_config(m: StepModel, w: WorkloadStats, t: Transport, rate: float, p: int, d: int,
              slo_ttft: float | None, slo_tpot: float | None) -> Config:
    """The PD model at ``rate`` on ``p`` prefill and ``d`` decode workers (inf where a role saturates)."""
    prompts = np.array([x for x, _ in w.lengths] or [w.prompt["mean"]], dtype=float)
    service = np.array([m.prefill_s(x) for x in prompts])
    rho_p = rate / p * service.mean()
    wait = rate / p * (service**2).mean() / (2 * (1 - rho_p)) if rho_p < 1 else math.inf
    om, ctx = w.output["mean"], w.prompt["mean"] + w.output["mean"] / 2
    rho_d = rate / d * om * (m.token_s + m.sequence_s + m.context_s * ctx)
    step = m.fixed_s / (1 - rho_d) if rho_d < 1 else math.inf
    seqs = rate / d * om * step
    if seqs > m.seats:   # the decode worker queues for seats (KV or max_batch_size)
        step = math.inf
    transfer = t.seconds(w.prompt["p95"], m.block)
    ttft = wait + m.prefill_s(w.prompt["p95"]) + transfer + step / 2
    return Config(p, d, False, ttft, step, rho_p, rho_d, seqs, transfer, _meets(ttft, step, slo_ttft, slo_tpot))


def plan_pd(m: StepModel, w: WorkloadStats, t: Transport, rate: float, colocated: Callable[[float], tuple],
            slo_ttft: float | None, slo_tpot: float | None, max_workers: int = 64) -> dict:
    """The fewest P + D workers meeting the SLO at ``rate`` (ties: the largest SLO slack), the colocated
    instances meeting it, and a table of both around the choice. ``colocated(rate per instance)``: (TTFT of the
    p95 prompt, TPOT) of one colocated engine (the planner's load model)."""
    if rate <= 0:
        raise PlanError(f"--rate must be > 0 for the PD plan, got {rate:g}")
    if slo_ttft is None and slo_tpot is None:
        raise PlanError("the PD plan needs an SLO: give --ttft-p95 and/or --tpot-p95")

    def slack(c: Config) -> float:
        return min((slo_ttft / c.ttft_s) if slo_ttft else math.inf, (slo_tpot / c.tpot_s) if slo_tpot else math.inf)

    def colo(n: int) -> Config:
        ttft, tpot = colocated(rate / n)
        return Config(n, 0, True, ttft, tpot, None, None, None, None, _meets(ttft, tpot, slo_ttft, slo_tpot))

    best = None
    for total in range(2, max_workers + 1):
        ok = [c for p in range(1, total) if (c := pd_config(m, w, t, rate, p, total - p, slo_ttft, slo_tpot)).meets]
        if ok:
            best = max(ok, key=slack)
            break
    colo_n = next((n for n in range(1, max_workers + 1) if colo(n).meets), None)
    rows: list[Config] = []
    if best is not None:
        p, d = best.prefill, best.decode
        for dp, dd in ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1)):
            if p + dp >= 1 and d + dd >= 1:
                rows.append(pd_config(m, w, t, rate, p + dp, d + dd, slo_ttft, slo_tpot))
        rows.append(colo(best.workers))
    if colo_n is not None and (best is None or colo_n != best.workers):
        rows.append(colo(colo_n))
    return {"recommended": best.row() if best else None,
            "colocated_instances": colo_n,
            "table": [c.row() for c in rows],
            "transport": {"bytes_per_block": t.bytes_per_block, "bandwidth_bytes_per_s": t.bandwidth,
                          "source": t.source},
            "step_model": {k: getattr(m, k) for k in StepModel.__dataclass_fields__},
            "rate": rate, "slo": {"ttft_p95_s": slo_ttft, "tpot_s": slo_tpot}, "max_workers": max_workers}


def format_pd(pd: dict) -> str:
    """The PD table and the recommendation, as kiln plan prints them."""
    def ms(x) -> str:
        return "-" if x is None else "inf" if not math.isfinite(x) else f"{x * 1e3:.1f}"

    def pct(x) -> str:
        return "-" if x is None else f"{x:.0%}"

    def seqs(x) -> str:
        return "-" if x is None else "inf" if not math.isfinite(x) else f"{x:.1f}"

    t = pd["transport"]
    lines = [f"PD plan at {pd['rate']:g} req/s (TTFT p95 <= {ms(pd['slo']['ttft_p95_s'])} ms, TPOT <= "
             f"{ms(pd['slo']['tpot_s'])} ms); KV transfer: {t['bytes_per_block'] / 1e3:.1f} KB per block at "
             f"{t['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s ({t['source']})",
             f"{'config':<16} {'workers':>7} {'TTFT p95 ms':>11} {'TPOT ms':>8} {'prefill util':>12} "
             f"{'decode util':>11} {'decode seqs':>11} {'transfer ms':>11}  SLO "
             f"(decode seats per worker {pd['step_model']['seats']:.1f})"]
    for r in pd["table"]:
        lines.append(f"{r['config']:<16} {r['workers']:>7} {ms(r['ttft_p95_s']):>11} {ms(r['tpot_s']):>8} "
                     f"{pct(r['prefill_util']):>12} {pct(r['decode_util']):>11} {seqs(r['decode_seqs']):>11} "
                     f"{ms(r['transfer_p95_s']):>11}  "
                     f"{'met' if r['meets_slo'] else 'missed'}")
    rec, n = pd["recommended"], pd["colocated_instances"]
    within = f"within {pd['max_workers']} workers"
    colocated = (f"colocated needs {n} instance{'s' if n != 1 else ''}" if n
                 else f"colocated meets it with no count {within}")
    lines.append((f"recommended: {rec['config']} ({rec['workers']} workers)" if rec else
                  f"recommended: no P/D split meets the SLO {within}") + f"; {colocated}")
    return "\n".join(lines)
