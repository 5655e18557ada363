"""``kiln bench`` against a disaggregated (prefill/decode) server: the KV transfer and the TTFT split per rate.

Where the numbers come from: the server's own ``/metrics`` (``kiln serve --prefill-workers``; or ``stats()``
of an in-process ``DisaggLLM``), read before and after each rate, so each rate reports its own deltas: KV bytes,
blocks and transfers moved, failed transfers, the wire time per request (``kiln_kv_transfer_seconds``) and the
TTFT split (``kiln_ttft_prefill_seconds``: arrival to the prefill worker's first token; ``kiln_ttft_transfer_seconds``:
from there to the decode worker's first token), as mean and p50/p95 by bucket interpolation; and the requests in
flight per role: the mean from the server's request-seconds counter (``kiln_disagg_request_seconds_total{role}``,
the time integral of the in-flight gauge) over the time between the two reads, so it does not depend on when or
whether a poll happened; the max from the gauge ``kiln_disagg_requests{role}`` as read before, during (endpoints'
polls) and after the rate. No per-response field is needed, so any client (the OpenAI and Triton ones alike) gets
them.
"""

from __future__ import annotations

from kiln.bench.stats import histogram_quantile

COUNTERS = {"kv_bytes": "kiln_kv_transfer_bytes_total", "kv_blocks": "kiln_kv_transfer_blocks_total",
            "kv_transfers": "kiln_kv_transfers_total", "kv_failed": "kiln_kv_transfers_failed_total"}
HISTOGRAMS = {"transfer": "kiln_kv_transfer_seconds", "ttft_prefill": "kiln_ttft_prefill_seconds",
              "ttft_transfer": "kiln_ttft_transfer_seconds"}
STATS_HISTOGRAMS = {"transfer": "kv_transfer_time", "ttft_prefill": "ttft_prefill", "ttft_transfer": "ttft_transfer"}
ROLES = ("prefill", "decode")


def _by_role(labelled: dict[str, float], name: str, role: str) -> float | None:
    """A per-role series summed over its other labels (None when the page has none)."""
    hits = [v for k, v in labelled.items() if k.partition("{")[0] == name and f'role="{role}"' in k]
    return sum(hits) if hits else None


def from_samples(samples: dict[str, float], labelled: dict[str, float] | None = None) -> dict:
    """The PD numbers of a parsed Prometheus page, under ``disagg_*`` keys ({} for a colocated server).
    ``samples``: with labels other than ``le`` dropped (``canonical_metrics``); ``labelled``: the page as parsed,
    for the per-role series (default ``samples``)."""
    labelled = samples if labelled is None else labelled
    if COUNTERS["kv_transfers"] not in samples:
        return {}
    out: dict = {f"disagg_{k}": samples[name] for k, name in COUNTERS.items() if name in samples}
    for key, name in HISTOGRAMS.items():
        if f"{name}_count" in samples:
            prefix = f'{name}_bucket{{le="'
            buckets = sorted((float("inf") if k[len(prefix):-2] in ("+Inf", "Inf") else float(k[len(prefix):-2]), v)
                             for k, v in samples.items() if k.startswith(prefix))
            out[f"disagg_{key}"] = {"sum": samples.get(f"{name}_sum", 0.0), "count": samples[f"{name}_count"],
                                    "buckets": buckets}
    for role in ROLES:
        for key, name in (("queue", "kiln_disagg_requests"), ("request_seconds", "kiln_disagg_request_seconds_total")):
            if (value := _by_role(labelled, name, role)) is not None:
                out[f"disagg_{key}_{role}"] = value
    return out


def from_stats(stats: dict) -> dict:
    """The same numbers from an in-process ``DisaggLLM.stats()`` ({} for a colocated LLM)."""
    d = stats.get("disagg")
    if not d:
        return {}
    t = d["kv_transfer"]
    out: dict = {"disagg_kv_bytes": t["bytes"], "disagg_kv_blocks": t["blocks"], "disagg_kv_transfers": t["transfers"],
                 "disagg_kv_failed": t["failed"]}
    for key, name in STATS_HISTOGRAMS.items():
        h = stats["histograms"][name]
        out[f"disagg_{key}"] = {"sum": h["sum"], "count": h["count"], "buckets": [tuple(b) for b in h["buckets"]]}
    out.update({f"disagg_queue_{role}": d["queues"][role] for role in ROLES})
    out.update({f"disagg_request_seconds_{role}": d["request_seconds"][role] for role in ROLES})
    return out


def _histogram_delta(before: dict, after: dict, key: str) -> dict:
    a, b = after.get(f"disagg_{key}"), before.get(f"disagg_{key}") or {"sum": 0.0, "count": 0.0, "buckets": []}
    if a is None:
        return {"count": 0, "mean": None, "p50": None, "p95": None}
    n = a["count"] - b["count"]
    was = dict(b["buckets"])
    buckets = [(le, v - was.get(le, 0.0)) for le, v in a["buckets"]]
    return {"count": int(n), "mean": (a["sum"] - b["sum"]) / n if n > 0 else None,
            "p50": histogram_quantile(buckets, 0.5) if n > 0 else None,
            "p95": histogram_quantile(buckets, 0.95) if n > 0 else None}


def rate_section(before: dict, after: dict, series: list[dict], window_s: float) -> dict | None:
    """One rate's PD report (None when the target is not a PD server); ``window_s``: the seconds between the
    ``before`` and ``after`` reads."""
    if "disagg_kv_transfers" not in after:
        return None
    delta = {k: after.get(f"disagg_{k}", 0.0) - before.get(f"disagg_{k}", 0.0) for k in COUNTERS}
    n = delta["kv_transfers"]
    out = {"kv_transfer_bytes": delta["kv_bytes"], "kv_transfer_blocks": delta["kv_blocks"], "transfers": int(n),
           "transfers_failed": int(delta["kv_failed"]),
           "bytes_per_request": delta["kv_bytes"] / n if n else None,
           "transfer_time_s": _histogram_delta(before, after, "transfer"),
           "ttft_prefill_s": _histogram_delta(before, after, "ttft_prefill"),
           "ttft_transfer_s": _histogram_delta(before, after, "ttft_transfer")}
    for role in ROLES:
        key = f"disagg_request_seconds_{role}"
        seen = [r[f"disagg_queue_{role}"] for r in (before, *series, after) if f"disagg_queue_{role}" in r]
        if key not in after or not seen or window_s <= 0:
            out[f"queue_{role}"] = None
            continue
        area = after[key] - before.get(key, 0.0)
        out[f"queue_{role}"] = {"mean": area / window_s, "max_read": max(seen),   # polls can miss a short peak
                                "request_seconds": area}
    out["window_s"] = window_s
    out["source"] = "server /metrics (or stats()) after - before this rate; quantiles by bucket interpolation"
    return out


def series_row(metrics: dict) -> dict:
    """What a poll of the target adds to the time series: the requests in flight per role."""
    return {k: metrics[k] for k in (f"disagg_queue_{r}" for r in ROLES) if k in metrics}


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def format_lines(result: dict) -> list[str]:
    """The report's lines for a PD target (none otherwise)."""
    lines = []
    for run in result["runs"]:
        d = run.get("disagg")
        if not d:
            continue
        t, p, x = d["transfer_time_s"], d["ttft_prefill_s"], d["ttft_transfer_s"]
        per = d["bytes_per_request"]
        queues = ", ".join(f"{role} {q['mean']:.2f} mean / {q['max_read']:g} max read" for role in ROLES
                           if (q := d[f"queue_{role}"]) is not None)
        lines.append(f"PD rate {run['rate']}: KV moved {d['kv_transfer_bytes'] / 1e6:.2f} MB in {d['transfers']} "
                     f"transfers ({'-' if per is None else f'{per / 1e3:.1f}'} KB/request, {d['transfers_failed']} "
                     f"failed), wire time p50/p95 {_ms(t['p50'])}/{_ms(t['p95'])} ms; TTFT split: prefill p50/p95 "
                     f"{_ms(p['p50'])}/{_ms(p['p95'])} ms, transfer p50/p95 {_ms(x['p50'])}/{_ms(x['p95'])} ms"
                     + (f"; requests in flight per role: {queues}" if queues else ""))
    return lines
