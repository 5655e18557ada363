"""Replay a workload against a target at one rate, or a sweep of rates, and account for every request.

The client sends each request at its scheduled time from one asyncio loop; prompts are made before the
clock starts so that nothing but the send itself sits on the schedule. ``send lag`` (sent - scheduled)
measures how well the client kept its schedule; the result says when it fell behind.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import Counter

from kiln.bench import disagg
from kiln.bench.stats import SLO, goodput, knee, saturation_rate, summary
from kiln.bench.targets import ABORTED, COMPLETED, FAILED, OUTCOMES, REJECTED, RequestRecord
from kiln.bench.workload import PromptSynthesizer, Workload
from kiln.runtime.step_time import fit_step_time

# The client is "behind schedule" when its p99 send lag exceeds this (seconds).
LAG_LIMIT_S = 0.010
NO_SLO = SLO()
# A request "queued" when it waited longer than this many median step times before its first step.
QUEUED_STEPS = 2.0

_COUNTERS = ("preemptions", "steps", "prefill_tokens", "generation_tokens", "step_time_sum", "engine_time_sum",
             "spec_proposed_tokens", "spec_accepted_tokens", "spec_verify_steps")


def _delta(after: dict, before: dict, name: str) -> float | None:
    a, b = after.get(name), before.get(name)
    return None if a is None or b is None else a - b


async def _poll_metrics(target, origin: float, interval: float, out: list, stop: asyncio.Event) -> None:
    base = None
    while not stop.is_set():
        s = await asyncio.to_thread(target.metrics)
        if s:
            pre = s.get("preemptions") or 0.0
            base = pre if base is None else base
            out.append({"t": time.perf_counter() - origin, "running": s.get("running"), "waiting": s.get("waiting"),
                        "kv_usage": s.get("kv_usage"), "kv_blocks_used": s.get("kv_blocks_used"),
                        "kv_blocks_total": s.get("kv_blocks_total"), "prefix_hit_rate": s.get("prefix_hit_rate"),
                        "preemptions": pre - base, **disagg.series_row(s)})
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


def _step_series(steps: list, origin_mono: float, t_end: float) -> list[dict]:
    """Time series from the in-process runtime's step records (exact: one row per engine step)."""
    rows, pre = [], 0
    for s in steps:
        t = s.time - origin_mono
        if t < 0 or t > t_end:
            continue
        pre += s.num_preempted
        rows.append({"t": t, "running": s.num_running, "waiting": s.num_waiting, "kv_usage": s.kv_usage,
                     "prefix_hit_rate": s.prefix_hit_rate, "preemptions": pre, "step_time": s.step_time,
                     "engine_time": s.engine_time, "batch_size": s.batch_size,
                     "tokens": s.prefill_tokens + s.decode_tokens})
    return rows


def _queueing(series: list[dict], records: list[RequestRecord], preemptions: float | None) -> dict:
    """When the server could not admit what arrived: share of time with requests waiting, the number of
    running sequences at those moments, and requests whose own queue time exceeded a couple of steps."""
    rows = [r for r in series if r.get("running") is not None]
    if not rows:
        return {"source": "none (the target exposes no running/waiting gauges)"}
    # weight each sample by the time until the next one (a step's duration, or the poll interval)
    w = [max(b["t"] - a["t"], 0.0) for a, b in zip(rows, rows[1:])] + [0.0]
    total = sum(w) or 1.0
    queued = [(r, x) for r, x in zip(rows, w) if (r.get("waiting") or 0) > 0]
    qw = sum(x for _, x in queued)
    out = {
        "source": "runtime step records" if "step_time" in rows[0] else "polled /metrics gauges",
        "running_mean": sum(r["running"] * x for r, x in zip(rows, w)) / total,
        "running_max": max(r["running"] for r in rows),
        "waiting_time_fraction": qw / total,
        "running_while_waiting": (sum(r["running"] * x for r, x in queued) / qw) if qw > 0 else None,
        "preemptions": preemptions,
    }
    step_times = sorted(r["step_time"] for r in rows if "step_time" in r)
    qt = [r.queue_time for r in records if r.queue_time is not None]
    if step_times and qt:
        med = step_times[len(step_times) // 2]
        out["median_step_s"] = med
        out["requests_queued"] = sum(q > QUEUED_STEPS * med for q in qt)
    return out


async def run_rate(target, workload: Workload, synth: PromptSynthesizer, *, slo: SLO = NO_SLO, progress: bool = True,
                   timeout: float | None = None, poll_interval: float = 0.25, run_index: int = 0) -> dict:
    """Send ``workload`` (already at its rate) to ``target``; the result of this rate as a dict."""
    from tqdm import tqdm

    specs = workload.requests
    prompts = [synth.prompt(s, run_index) for s in specs]
    before = await asyncio.to_thread(target.metrics)
    read_before = time.perf_counter()
    records = [RequestRecord(s.index, s.arrival, s.prompt_len, s.output_len) for s in specs]
    bar = tqdm(total=len(specs), desc=f"rate {workload.description.get('rate')}", unit="req", disable=not progress,
               leave=False, dynamic_ncols=True)
    load_before = os.getloadavg()
    cpu_before = time.process_time()
    origin = time.perf_counter() + 0.05
    origin_mono = time.monotonic() + (origin - time.perf_counter())
    for r in records:
        r.scheduled += origin
    stop = asyncio.Event()
    series: list[dict] = []
    poller = None if _has_steps(target) else asyncio.create_task(
        _poll_metrics(target, origin, poll_interval, series, stop))

    async def one(rec: RequestRecord, prompt: list[int]) -> None:
        try:
            await target.send(rec, prompt)
        except asyncio.CancelledError:
            if rec.outcome is None:
                rec.outcome, rec.error_kind = ABORTED, "client_timeout"
        except Exception as exc:  # noqa: BLE001 - any client-side failure is counted, never lost
            rec.done = time.perf_counter()
            rec.outcome, rec.error_kind, rec.error = FAILED, f"client_{type(exc).__name__}", str(exc)[:300]
        finally:
            bar.update(1)

    tasks = []
    for rec, prompt in zip(records, prompts):
        delay = rec.scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(rec, prompt)))
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)
    t_end = time.perf_counter() - origin
    stop.set()
    if poller is not None:
        await poller
    bar.close()
    after = await asyncio.to_thread(target.metrics)
    window_s = time.perf_counter() - read_before
    for r in records:
        r.shift(origin)
        if r.outcome is None:  # cannot happen, but an unaccounted request must show
            r.outcome, r.error_kind = FAILED, "unaccounted"
    if _has_steps(target):
        series = _step_series(target.steps(), origin_mono, t_end)
    result = _rate_result(workload, records, series, before, after, slo, t_end, load_before, window_s)
    # CPU time this process got (the in-process engine's step loop included) per second of the run: on a
    # shared machine a low share next to a busy engine means other work took the cores
    cpu = time.process_time() - cpu_before
    result["machine"]["process_cpu_per_wall_s"] = cpu / max(t_end, 1e-9)
    busy = sum(r.get("step_time", 0.0) for r in series)
    if busy > 0:  # in-process: CPU per second the engine was stepping (~torch threads on a quiet machine)
        result["machine"]["process_cpu_per_busy_s"] = cpu / busy
    return result


def _has_steps(target) -> bool:
    return target.kind == "in-process"


def _rate_result(workload: Workload, records: list[RequestRecord], series: list[dict], before: dict, after: dict,
                 slo: SLO, t_end: float, load_before, window_s: float) -> dict:
    outcomes = Counter(r.outcome for r in records)
    done = [r for r in records if r.outcome == COMPLETED]
    first_sent = min((r.sent for r in records if r.sent is not None), default=0.0)
    last_done = max((r.done for r in records if r.done is not None), default=t_end)
    duration = max(last_done - first_sent, 1e-9)
    out_tokens = sum(r.output_tokens for r in done)
    lag = [r.sent - r.scheduled for r in records if r.sent is not None]
    lag_s = summary(lag)
    rate = workload.description.get("rate")
    sends = sorted(r.sent for r in records if r.sent is not None)
    ttft_s, tpot_s = summary(r.ttft for r in done), summary(r.tpot for r in done)
    queue = summary(r.queue_time for r in records if r.queue_time is not None)
    queue_source = "per request, from the runtime" if queue["count"] else None
    if not queue["count"] and "queue_count" in after:
        n = after["queue_count"] - before.get("queue_count", 0.0)
        if n > 0:
            from kiln.bench.stats import histogram_quantile

            b_before = dict(before.get("queue_buckets", []))
            buckets = [(le, v - b_before.get(le, 0.0)) for le, v in after["queue_buckets"]]
            queue = {"count": int(n), "mean": (after["queue_sum"] - before.get("queue_sum", 0.0)) / n,
                     **{f"p{q}": histogram_quantile(buckets, q / 100) for q in (50, 90, 95, 99)}}
            queue_source = "server /metrics histogram (bucket interpolation)"
    server = {k: _delta(after, before, k) for k in _COUNTERS}
    kv = [r["kv_usage"] for r in series if r.get("kv_usage") is not None]
    hit = [r["prefix_hit_rate"] for r in series if r.get("prefix_hit_rate") is not None]
    st = sum(r.get("step_time", 0.0) for r in series)
    if st > 0:  # in-process only: the step loop's own time (scheduling, packing, sampling) beside engine.run
        server["step_loop_overhead_fraction"] = (st - sum(r["engine_time"] for r in series)) / st
    server.update(kv_usage_max=max(kv) if kv else None, kv_usage_mean=sum(kv) / len(kv) if kv else None,
                  prefix_hit_rate_end=hit[-1] if hit else None,
                  kv_blocks_total=after.get("kv_blocks_total"))
    errors = Counter(r.error_kind for r in records if r.outcome != COMPLETED)
    first_errors = {}
    for r in records:
        if r.outcome != COMPLETED and r.error_kind not in first_errors:
            first_errors[r.error_kind] = r.error
    result = {
        "rate": rate,
        "workload": workload.description,
        "duration_s": duration,
        "requests": {"sent": sum(r.sent is not None for r in records), "scheduled": len(records),
                     **{o: outcomes.get(o, 0) for o in OUTCOMES},
                     "short_outputs": sum(r.output_tokens < r.output_len for r in done),
                     "errors_by_kind": dict(errors), "first_error_by_kind": first_errors},
        "latency_s": {"ttft": ttft_s, "tpot": tpot_s, "itl": summary(x for r in done for x in r.itl),
                      "e2e": summary(r.e2e for r in done), "queue": {**queue, "source": queue_source}},
        "throughput": {"requests_per_s": len(done) / duration, "output_tokens_per_s": out_tokens / duration,
                       "completion_rate": _completion_rate(done),
                       "total_tokens_per_s": (out_tokens + sum(r.prompt_len for r in done)) / duration,
                       "goodput_requests_per_s": goodput([(r.ttft, r.tpot) for r in done], duration, slo)},
        "slo_met": slo.run_ok(ttft_s, tpot_s) and len(done) == len(records),
        "client": {"send_lag_s": lag_s,
                   "behind_schedule": bool(lag_s["p99"] is not None and lag_s["p99"] > LAG_LIMIT_S),
                   "lag_limit_s": LAG_LIMIT_S,
                   "send_rate": ((len(sends) - 1) / (sends[-1] - sends[0])
                                 if len(sends) > 1 and sends[-1] > sends[0] else None)},
        "server": server,
        "queueing": _queueing(series, records, server.get("preemptions")),
        "machine": {"loadavg_1m_before": load_before[0], "loadavg_1m_after": os.getloadavg()[0]},
        "timeseries": series,
        "per_request": [r.as_dict() for r in records],
    }
    pd = disagg.rate_section(before, after, series, window_s)
    if pd is not None:
        result["disagg"] = pd
    return result


def _completion_rate(done: list[RequestRecord]) -> float | None:
    """Completions per second between the first and the last completion: the rate the server sustained,
    free of the run's ramp-up and drain (requests/s over the whole run is below the offered rate by
    (latency x rate) / n even when the server keeps up)."""
    t = sorted(r.done for r in done)
    return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 2 and t[-1] > t[0] else None


def shows_queueing(run: dict, min_fraction: float = 0.05) -> bool:
    """A run 'shows queueing' when requests waited for admission for >= 5% of the time or any was preempted."""
    q = run["queueing"]
    return bool((q.get("waiting_time_fraction") or 0.0) >= min_fraction or (q.get("preemptions") or 0) > 0)


def sweep_summary(runs: list[dict], slo: SLO) -> dict:
    """Knee (highest rate meeting the SLO), saturation (throughput stops following the rate), queueing onset."""
    finite = [r for r in runs if isinstance(r["rate"], (int, float)) and math.isfinite(r["rate"])]
    rates = [r["rate"] for r in finite]
    onset = next((r for r in sorted(finite, key=lambda r: r["rate"]) if shows_queueing(r)), None)
    return {
        "knee_rate": knee(rates, [r["slo_met"] for r in finite]) if slo.defined else None,
        "saturation_rate": saturation_rate(rates, [r["throughput"]["completion_rate"] or 0.0 for r in finite]),
        "max_output_tokens_per_s": max((r["throughput"]["output_tokens_per_s"] for r in runs), default=None),
        "queueing_onset": None if onset is None else {
            "rate": onset["rate"], "running_while_waiting": onset["queueing"].get("running_while_waiting"),
            "running_max": onset["queueing"].get("running_max"),
            "waiting_time_fraction": onset["queueing"].get("waiting_time_fraction"),
            "preemptions": onset["queueing"].get("preemptions")},
        "client_behind_schedule_at": [r["rate"] for r in runs if r["client"]["behind_schedule"]],
    }


def calibration(runs: list[dict], facts) -> dict | None:
    """Measured step costs: per-step records (in-process) or per-rate /metrics counters, fitted as
    engine time = a x steps + b x tokens; a -> bandwidth (streamed weights / a), b -> FLOP/s (2 x params / b)."""
    rows, source = [], None
    for r in runs:
        for s in r["timeseries"]:
            if "engine_time" in s:
                rows.append((1.0, float(s["tokens"]), float(s["engine_time"])))
                source = "runtime step records (engine.run time per step)"
    if not rows:
        for r in runs:
            sv = r["server"]
            if sv.get("steps") and sv.get("step_time_sum") is not None and sv.get("prefill_tokens") is not None:
                tokens = sv["prefill_tokens"] + (sv.get("generation_tokens") or 0)
                rows.append((sv["steps"], tokens, sv["step_time_sum"]))
        source = ("per-rate /metrics deltas: step time sum = a x steps + b x (prefill tokens computed + "
                  "generated tokens)")
    fit = fit_step_time(rows)
    if fit is None or fit["step_fixed_s"] <= 0 or fit["per_token_s"] <= 0:
        return None
    fit["source"] = source
    if facts is not None:
        fit["bandwidth_bytes_per_s"] = facts.streamed_weight_bytes / fit["step_fixed_s"]
        fit["flops_per_s"] = 2 * facts.matmul_params / fit["per_token_s"]
        fit["engine"] = facts.name
    return fit


def environment() -> dict:
    import platform

    import torch

    try:
        from importlib.metadata import version

        kiln_version = version("kiln-llm")
    except Exception:  # noqa: BLE001
        kiln_version = "unknown"
    return {"kiln": kiln_version, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}


__all__ = ["run_rate", "sweep_summary", "calibration", "shows_queueing", "environment", "REJECTED"]


async def run_sweep(target, workload: Workload, synth: PromptSynthesizer, rates: list[float] | str, *, slo: SLO,
                    progress: bool = True, timeout: float | None = None, start_rate: float = 0.5,
                    max_runs: int = 6, log=print) -> list[dict]:
    """One run per rate (``rates`` a list, or "auto": double from ``start_rate`` until the SLO fails or
    throughput stops following the rate, then one run halfway between the last good and first bad rate)."""
    runs: list[dict] = []

    async def one(rate: float) -> dict:
        run = await run_rate(target, workload.at_rate(rate), synth, slo=slo, progress=progress, timeout=timeout,
                             run_index=len(runs))
        runs.append(run)
        t, lat = run["throughput"], run["latency_s"]
        log(f"rate {run['rate']}: {run['requests']['completed']}/{run['requests']['scheduled']} completed, "
            f"{t['requests_per_s']:.3g} req/s, {t['output_tokens_per_s']:.3g} out tok/s, TTFT p95 "
            f"{_fmt_s(lat['ttft']['p95'])}, TPOT p95 {_fmt_s(lat['tpot']['p95'])}, "
            f"SLO {'met' if run['slo_met'] else 'missed'}")
        return run

    if rates != "auto":
        for rate in rates:
            await one(rate)
        return runs
    rate, good, bad = start_rate, None, None
    while len(runs) < max_runs:
        run = await one(rate)
        saturated = (run["throughput"]["completion_rate"] or 0.0) < 0.9 * rate
        if run["slo_met"] and not saturated:
            good = rate
            rate *= 2
        else:
            bad = rate
            break
    if good is not None and bad is not None and len(runs) < max_runs + 1:
        await one(round((good + bad) / 2, 6))
    runs.sort(key=lambda r: r["rate"])
    return runs


def _fmt_s(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"
