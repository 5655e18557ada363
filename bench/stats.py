"""The numbers of a run: percentiles, throughput, goodput, the knee of a sweep, a step-time fit.

Percentiles use linear interpolation between order statistics (numpy's default), so they can be checked
against ``numpy.percentile`` on the same data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 95, 99)


def summary(values) -> dict:
    """count, mean, p50/p90/p95/p99, min, max of the finite values (None when there are none)."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if x.size == 0:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}, "min": None, "max": None}
    out = {"count": int(x.size), "mean": float(x.mean())}
    out.update({f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(x, PERCENTILES))})
    out.update(min=float(x.min()), max=float(x.max()))
    return out


@dataclass(frozen=True)
class SLO:
    """Latency objective: p95 TTFT and p95 TPOT bounds in seconds (None = no bound)."""

    ttft_p95: float | None = None
    tpot_p95: float | None = None

    @property
    def defined(self) -> bool:
        return self.ttft_p95 is not None or self.tpot_p95 is not None

    def request_ok(self, ttft: float | None, tpot: float | None) -> bool:
        """Does one completed request meet both bounds? (a one-token request has no TPOT: vacuously met)"""
        if self.ttft_p95 is not None and (ttft is None or ttft > self.ttft_p95):
            return False
        if self.tpot_p95 is not None and tpot is not None and tpot > self.tpot_p95:
            return False
        return True

    def run_ok(self, ttft_summary: dict, tpot_summary: dict) -> bool:
        """Does a run meet the SLO at p95?"""
        if self.ttft_p95 is not None and (ttft_summary["p95"] is None or ttft_summary["p95"] > self.ttft_p95):
            return False
        if self.tpot_p95 is not None and tpot_summary["p95"] is not None and tpot_summary["p95"] > self.tpot_p95:
            return False
        return True

    def as_dict(self) -> dict:
        return {"ttft_p95_s": self.ttft_p95, "tpot_p95_s": self.tpot_p95}


def goodput(completed: list[tuple[float | None, float | None]], duration: float, slo: SLO) -> float:
    """Requests per second that completed within the SLO (each (ttft, tpot) judged on its own)."""
    if duration <= 0:
        return 0.0
    return sum(slo.request_ok(t, p) for t, p in completed) / duration


def knee(rates: list[float], slo_met: list[bool]) -> float | None:
    """Highest rate of the sweep at which the SLO holds, counting only rates below the first failure
    (a later lucky pass above a failure is noise, not capacity)."""
    best = None
    for r, ok in sorted(zip(rates, slo_met)):
        if not ok:
            break
        best = r
    return best


def saturation_rate(offered: list[float], achieved: list[float], keep_up: float = 0.9) -> float | None:
    """First offered rate whose achieved request throughput falls below ``keep_up`` x offered: the load at
    which throughput stops following the offered rate."""
    for o, a in sorted(zip(offered, achieved)):
        if math.isfinite(o) and a < keep_up * o:
            return o
    return None


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style quantile from cumulative (upper bound, count) buckets, linear within a bucket."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 0.0)
        prev_le, prev_n = le, n
    return prev_le


