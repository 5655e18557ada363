"""kiln.bench statistics against numpy on fixed data: percentiles, goodput, knee, histogram quantiles, step fit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.bench.stats import SLO, goodput, histogram_quantile, knee, saturation_rate, summary
from kiln.runtime.step_time import fit_step_time

DATA = [0.12, 0.5, 0.07, 3.2, 0.9, 0.33, 0.41, 1.7, 0.05, 0.66, 2.4, 0.2]


def test_summary_matches_numpy():
    s = summary(DATA + [None, float("nan")])          # missing values are skipped, not counted as zero
    x = np.array(DATA)
    assert s["count"] == len(DATA)
    assert s["mean"] == pytest.approx(x.mean())
    for q in (50, 90, 95, 99):
        assert s[f"p{q}"] == pytest.approx(np.percentile(x, q))
    assert (s["min"], s["max"]) == (x.min(), x.max())
    assert summary([])["p95"] is None and summary([])["count"] == 0


def test_goodput_counts_requests_within_both_bounds():
    reqs = [(0.5, 0.02), (1.4, 0.05), (2.0, 0.01), (0.9, None), (None, None)]
    slo = SLO(ttft_p95=1.5, tpot_p95=0.03)
    # (0.5, 0.02) ok; (1.4, 0.05) TPOT too slow; (2.0, .) TTFT too slow; (0.9, None) a 1-token request: ok;
    # (None, None): no first token, never ok
    assert goodput(reqs, duration=4.0, slo=slo) == pytest.approx(2 / 4.0)
    assert goodput(reqs, duration=4.0, slo=SLO()) == pytest.approx(5 / 4.0)
    assert goodput(reqs, duration=0.0, slo=slo) == 0.0


def test_run_slo_uses_p95():
    ttft = summary(DATA)
    tpot = summary([0.01] * 10)
    p95 = float(np.percentile(DATA, 95))          # 2.76, while the slowest request took 3.2
    assert SLO(ttft_p95=p95 + 0.01).run_ok(ttft, tpot) is True
    assert SLO(ttft_p95=p95 - 0.01).run_ok(ttft, tpot) is False
    assert SLO(tpot_p95=0.005).run_ok(ttft, tpot) is False
    assert SLO().defined is False and SLO(ttft_p95=1).defined


def test_knee_and_saturation():
    assert knee([4, 1, 2, 8], [False, True, True, True]) == 2       # 8 passing after 4 failed is noise
    assert knee([1, 2], [False, True]) is None
    assert saturation_rate([1, 2, 4, 8], [1.0, 1.95, 3.1, 3.3]) == 4
    assert saturation_rate([1, 2], [1.0, 2.0]) is None


def test_histogram_quantile_interpolates_within_buckets():
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(buckets, 0.25) == pytest.approx(0.1)
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert histogram_quantile(buckets, 0.95) == pytest.approx(0.5 + 0.5 * (38 - 30) / 10)
    assert histogram_quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5) is None


def test_step_fit_recovers_fixed_and_per_token_cost():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 300, size=200)
    secs = 0.010 + 0.002 * tokens + rng.normal(0, 1e-4, size=200)
    fit = fit_step_time([(1.0, float(t), float(s)) for t, s in zip(tokens, secs)])
    assert fit["step_fixed_s"] == pytest.approx(0.010, rel=0.02)
    assert fit["per_token_s"] == pytest.approx(0.002, rel=0.01)
    assert fit["r2"] > 0.99
    # aggregated rows (steps, tokens, seconds) give the same answer
    agg = [(100.0, 3000.0, 100 * 0.010 + 3000 * 0.002), (50.0, 4000.0, 50 * 0.010 + 4000 * 0.002)]
    fit2 = fit_step_time(agg)
    assert fit2["step_fixed_s"] == pytest.approx(0.010) and fit2["per_token_s"] == pytest.approx(0.002)
    assert fit_step_time([(1.0, 5.0, 0.1)]) is None
    assert fit_step_time([(1.0, 5.0, 0.1), (2.0, 10.0, 0.2)]) is None           # collinear: cannot separate
