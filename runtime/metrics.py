"""Runtime metrics: per-step records, counters and latency histograms.

The executor updates one :class:`RuntimeMetrics` from its step loop; readers (``LLM.stats()``, the
benchmark, the HTTP server's Prometheus collector in ``kiln.serving``) take :meth:`RuntimeMetrics.snapshot`,
which is safe to call from any thread and carries the histograms' cumulative buckets and sums. The runtime
keeps the numbers; exposition formats belong to the servers.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from dataclasses import dataclass, field

from kiln.runtime.outputs import REQUEST_CLASSES, request_class

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics) plus a window of recent samples for percentiles."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS, window: int = 10000):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)   # last = +Inf
        self.count = 0
        self.sum = 0.0
        self.samples: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value
        self.samples.append(value)

    def percentile(self, q: float) -> float | None:
        """q in [0, 100] over the recent window (nearest-rank with linear interpolation)."""
        if not self.samples:
            return None
        xs = sorted(self.samples)
        pos = (len(xs) - 1) * q / 100.0
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    def summary(self) -> dict:
        return {
            "count": self.count, "sum": self.sum, "mean": self.sum / self.count if self.count else None,
            "p50": self.percentile(50), "p90": self.percentile(90), "p95": self.percentile(95),
            "p99": self.percentile(99), "buckets": self.cumulative(),
        }

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) per bucket, the last bound being +inf (Prometheus semantics)."""
        out, acc = [], 0
        for b, c in zip([*self.buckets, math.inf], self.counts):
            acc += c
            out.append((b, acc))
        return out


@dataclass
class StepRecord:
    time: float                # monotonic time the step ended
    step_time: float           # whole step, seconds
    engine_time: float         # engine.run only
    num_running: int
    num_waiting: int
    num_preempted: int         # preemptions in this step
    batch_size: int            # sequences in the forward
    prefill_tokens: int
    decode_tokens: int
    sampled_tokens: int        # tokens generated (decodes + prefills that reached their last token)
    kv_usage: float
    prefix_hit_rate: float

    @property
    def overhead(self) -> float:
        return self.step_time - self.engine_time


@dataclass
class SpeculativeStats:
    """Speculative decoding's verify steps: proposals, acceptances, per draft position (under the metrics lock)."""

    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0          # sequence-steps that verified at least one proposal
    per_position: list[list[int]] = field(default_factory=list)   # [proposed, accepted] per draft position

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.verify_steps += 1
        while len(self.per_position) < proposed:
            self.per_position.append([0, 0])
        for j in range(proposed):
            self.per_position[j][0] += 1
            self.per_position[j][1] += j < accepted

    def snapshot(self) -> dict:
        return {
            "proposed_tokens": self.proposed, "accepted_tokens": self.accepted, "verify_steps": self.verify_steps,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
            "acceptance_per_position": [a / p if p else None for p, a in self.per_position],
            "counts_per_position": [list(x) for x in self.per_position],   # [proposed, accepted]
            # tokens a verifying sequence emits per step: its accepted proposals plus the target's own token
            "mean_tokens_per_step": (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps
            else None,
        }


HISTOGRAMS = ("ttft", "tpot", "queue_time", "e2e_latency", "step_time", "inter_token_latency",
              "grammar_compile_time")
# per step with constrained rows: filling and applying their token bitmasks (tens of microseconds and up)
MASK_TIME_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)
# per request class (online / batch): f"{name}_{class}"
CLASS_HISTOGRAMS = ("ttft", "tpot", "queue_time")
# How requests end: the RequestOutput finish reasons, plus "error" for those the step loop failed.
OUTCOMES = ("stop", "length", "abort", "error")


class RuntimeMetrics:
    def __init__(self, window: int = 4096):
        self.lock = threading.Lock()
        self.steps: deque[StepRecord] = deque(maxlen=window)
        self.hist = {name: Histogram() for name in HISTOGRAMS}
        self.hist["batch_size"] = Histogram(buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.hist["grammar_mask_time"] = Histogram(buckets=MASK_TIME_BUCKETS)
        for cls in REQUEST_CLASSES:
            for name in CLASS_HISTOGRAMS:
                self.hist[f"{name}_{cls}"] = Histogram()
        self.counters = {
            "steps": 0, "requests_submitted": 0, "requests_finished": 0, "requests_aborted": 0,
            "requests_rejected": 0, "preemptions": 0, "prompt_tokens": 0, "generation_tokens": 0,
            "prefill_tokens_computed": 0, "decode_tokens_computed": 0, "engine_time": 0.0, "step_time": 0.0,
            # structured output: requests with a constraint, and whether their grammar was compiled already
            "structured_requests": 0, "grammar_cache_hits": 0, "grammar_cache_misses": 0,
            # per request class, counted when a request ends
            **{f"{n}_{cls}": 0 for cls in REQUEST_CLASSES for n in ("requests_ended", "generated_tokens")},
        }
        self.gauges = {"running": 0, "waiting": 0, "kv_usage": 0.0, "kv_blocks_total": 0, "kv_blocks_used": 0,
                       "kv_blocks_cached": 0, "prefix_hit_rate": 0.0, "kv_evictions": 0,
                       **{f"{n}_{cls}": 0 for cls in REQUEST_CLASSES for n in ("running", "waiting")}}
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.speculative = SpeculativeStats()

    def incr(self, name: str, value: float = 1) -> None:
        with self.lock:
            self.counters[name] += value

    def record_step(self, rec: StepRecord, kv_stats: dict, by_class: dict[str, int] | None = None) -> None:
        with self.lock:
            self.steps.append(rec)
            c = self.counters
            c["steps"] += 1
            c["preemptions"] += rec.num_preempted
            c["prefill_tokens_computed"] += rec.prefill_tokens
            c["decode_tokens_computed"] += rec.decode_tokens
            c["generation_tokens"] += rec.sampled_tokens
            c["engine_time"] += rec.engine_time
            c["step_time"] += rec.step_time
            self.hist["step_time"].observe(rec.step_time)
            self.hist["batch_size"].observe(rec.batch_size)
        self.set_gauges(rec.num_running, rec.num_waiting, kv_stats, by_class)

    def set_gauges(self, running: int, waiting: int, kv_stats: dict,
                   by_class: dict[str, int] | None = None) -> None:
        """The scheduler's queue lengths and the KV pool's state (a KVCacheStats dict) as of now; ``by_class``:
        "running_online", "waiting_batch", ... ."""
        with self.lock:
            self.gauges.update(by_class or {})
            self.gauges.update(running=running, waiting=waiting, kv_usage=kv_stats["usage"],
                               kv_blocks_total=kv_stats["num_blocks"], kv_blocks_used=kv_stats["used_blocks"],
                               kv_blocks_cached=kv_stats["cached_blocks"], prefix_hit_rate=kv_stats["hit_rate"],
                               kv_evictions=kv_stats["evictions"])

    def record_request(self, metrics, outcome: str) -> None:
        """Histograms of a finished request (a RequestMetrics) and how it ended (one of OUTCOMES)."""
        with self.lock:
            self.counters["requests_aborted" if outcome in ("abort", "error") else "requests_finished"] += 1
            self.outcomes[outcome] += 1
            cls = request_class(metrics.priority)
            self.counters[f"requests_ended_{cls}"] += 1
            self.counters[f"generated_tokens_{cls}"] += metrics.num_generated_tokens
            for name, value in (("ttft", metrics.ttft), ("tpot", metrics.mean_tpot),
                                ("queue_time", metrics.queue_time), ("e2e_latency", metrics.e2e_latency)):
                if value is not None:
                    self.hist[name].observe(value)
                    if name in CLASS_HISTOGRAMS:
                        self.hist[f"{name}_{cls}"].observe(value)

    def record_speculation(self, proposed: int, accepted: int) -> None:
        """One sequence's verify step: ``accepted`` of its ``proposed`` tokens were the target's."""
        with self.lock:
            self.speculative.record(proposed, accepted)

    def observe(self, name: str, value: float) -> None:
        with self.lock:
            self.hist[name].observe(value)

    def snapshot(self) -> dict:
        with self.lock:
            steps = list(self.steps)
            c = dict(self.counters)
            out = {
                "counters": c, "gauges": dict(self.gauges), "outcomes": dict(self.outcomes),
                "histograms": {k: h.summary() for k, h in self.hist.items()},
                "speculative": self.speculative.snapshot(),
            }
        if steps:
            st = sum(s.step_time for s in steps)
            out["recent_steps"] = {
                "count": len(steps),
                "mean_step_time": st / len(steps),
                "mean_batch_size": sum(s.batch_size for s in steps) / len(steps),
                "mean_tokens_per_step": sum(s.prefill_tokens + s.decode_tokens for s in steps) / len(steps),
                "overhead_fraction": sum(s.overhead for s in steps) / st if st else 0.0,
            }
        return out

    def summary_text(self) -> str:
        s = self.snapshot()
        c, g, h = s["counters"], s["gauges"], s["histograms"]

        def ms(x):
            return "-" if x is None else f"{x * 1e3:.1f} ms"

        lines = [
            f"requests: {c['requests_finished']} finished, {c['requests_aborted']} aborted, "
            f"{c['requests_rejected']} rejected; preemptions {c['preemptions']}",
            f"tokens: {c['prompt_tokens']} prompt, {c['prefill_tokens_computed']} prefill computed, "
            f"{c['generation_tokens']} generated; steps {c['steps']}",
            f"TTFT p50 {ms(h['ttft']['p50'])} p95 {ms(h['ttft']['p95'])} | TPOT p50 {ms(h['tpot']['p50'])} "
            f"p95 {ms(h['tpot']['p95'])} | queue p50 {ms(h['queue_time']['p50'])} | "
            f"e2e p50 {ms(h['e2e_latency']['p50'])}",
            f"KV: {g['kv_blocks_used']}/{g['kv_blocks_total']} blocks used, {g['kv_blocks_cached']} cached, "
            f"prefix hit rate {g['prefix_hit_rate']:.1%}, evictions {g['kv_evictions']}",
        ]
        if "recent_steps" in s:
            r = s["recent_steps"]
            lines.append(f"steps: mean {ms(r['mean_step_time'])}, batch {r['mean_batch_size']:.1f} seqs, "
                         f"{r['mean_tokens_per_step']:.1f} tokens/step, loop overhead {r['overhead_fraction']:.1%}")
        return "\n".join(lines)
