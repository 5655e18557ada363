"""Result files and printed tables of ``kiln bench``, and ``kiln bench compare``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kiln.bench import disagg

RESULT_FORMAT = 1


class ResultError(ValueError):
    """A file that is not a kiln bench result; the message names it."""


def write_result(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=_jsonable))


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def read_result(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("kiln_bench_result") != RESULT_FORMAT or "runs" not in data:
        raise ResultError(f"{path}: not a kiln bench result (format {RESULT_FORMAT}); write one with "
                          "`kiln bench ... --output DIR`")
    return data


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 1 else f"{x * 1e3:.1f}"


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _rate(r) -> str:
    return r if isinstance(r, str) else f"{r:g}"


def rate_rows(result: dict) -> list[list[str]]:
    rows = []
    for run in result["runs"]:
        lat, thr, req, q = run["latency_s"], run["throughput"], run["requests"], run["queueing"]
        rows.append([
            _rate(run["rate"]), f"{req['completed']}/{req['failed']}/{req['rejected']}/{req['aborted']}",
            _f(thr["requests_per_s"]), _f(thr["output_tokens_per_s"], ".1f"), _f(thr["goodput_requests_per_s"]),
            _ms(lat["ttft"]["p50"]), _ms(lat["ttft"]["p95"]), _ms(lat["tpot"]["p50"]), _ms(lat["tpot"]["p95"]),
            _ms(lat["e2e"]["p95"]), _ms(lat["queue"].get("p95")),
            _f(q.get("running_mean"), ".1f"), _f(q.get("waiting_time_fraction"), ".0%"),
            _f(run["server"].get("preemptions"), ".0f"), _f(run["server"].get("kv_usage_max"), ".0%"),
            ("yes" if run["slo_met"] else "no"), _ms(run["client"]["send_lag_s"]["p99"])
            + ("!" if run["client"]["behind_schedule"] else ""),
            _f(run["machine"]["loadavg_1m_after"], ".1f"),
            _f(run["machine"].get("process_cpu_per_busy_s", run["machine"].get("process_cpu_per_wall_s")), ".2f"),
        ])
    return rows


HEADER = ["rate", "ok/fail/429/abort", "req/s", "out tok/s", "goodput", "TTFT p50", "TTFT p95", "TPOT p50",
          "TPOT p95", "e2e p95", "queue p95", "running", "waiting", "preempt", "KV max", "SLO", "lag p99",
          "load", "cpu/s"]


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_result(result: dict) -> str:
    cfg, summ = result["config"], result["summary"]
    w = cfg["workload"]
    lines = [f"kiln bench: {cfg['target'].get('kind')} {cfg['target'].get('engine') or cfg['target'].get('endpoint')}",
             "workload: " + ", ".join(f"{k}={v}" for k, v in w.items() if k not in ("rate", "time_scale")),
             f"SLO: p95 TTFT <= {_ms(cfg['slo']['ttft_p95_s'])} ms, p95 TPOT <= {_ms(cfg['slo']['tpot_p95_s'])} ms "
             "(latencies in ms; requests completed/failed/rejected 429/aborted; 'running' = mean sequences running, "
             "'waiting' = share of time with requests waiting for admission; '!' = client behind schedule; "
             "'load' = 1-min load average at the end of the rate, 'cpu/s' = CPU seconds this process got per "
             "second the engine was stepping (in-process; about the torch threads when the cores are free) or "
             "per second of the run (endpoint))",
             format_table(HEADER, rate_rows(result))]
    onset = summ.get("queueing_onset")
    lines.append(f"knee (highest rate meeting the SLO): {_f(summ['knee_rate'], 'g')} req/s; throughput stops following "
                 f"the rate at: {_f(summ['saturation_rate'], 'g')} req/s; queueing/preemption first shows at: "
                 + ("none" if not onset else f"{onset['rate']:g} req/s with "
                                             f"{_f(onset['running_while_waiting'], '.1f')} "
                    f"sequences running (max {onset['running_max']})"))
    if summ.get("client_behind_schedule_at"):
        lines.append(f"WARNING: the client fell behind its schedule (p99 send lag > "
                     f"{result['runs'][0]['client']['lag_limit_s'] * 1e3:.0f} ms) at rates "
                     f"{summ['client_behind_schedule_at']}: those rates measure the client too")
    cal = result.get("calibration")
    if cal:
        lines.append(f"step-time fit ({cal['source']}, {cal['rows']} rows, R^2 {cal['r2']:.2f}): "
                     f"{cal['step_fixed_s'] * 1e3:.1f} ms per step + {cal['per_token_s'] * 1e3:.2f} ms per token"
                     + (f" -> {cal['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s effective, "
                        f"{cal['flops_per_s'] / 1e9:.0f} GFLOP/s effective" if "flops_per_s" in cal else ""))
    spec = [(run["rate"], run["server"]) for run in result["runs"] if run["server"].get("spec_proposed_tokens")]
    if spec:
        lines.append("speculative decoding (accepted / proposed tokens; tokens per verifying sequence-step): "
                     + "; ".join(
            f"rate {_rate(rate)}: {s['spec_accepted_tokens'] / s['spec_proposed_tokens']:.0%}"
            + (f", {(s['spec_accepted_tokens'] + s['spec_verify_steps']) / s['spec_verify_steps']:.2f}"
               if s.get("spec_verify_steps") else "") for rate, s in spec))
    lines.extend(disagg.format_lines(result))
    m = result.get("machine", {})
    if m:
        lines.append(f"machine: {m.get('cpus')} CPUs, 1-min load {_f(m.get('loadavg_1m_start'), '.1f')} at start, "
                     f"{_f(m.get('loadavg_1m_end'), '.1f')} at end; kiln {result['versions']['kiln']}, "
                     f"torch {result['versions']['torch']}")
    return "\n".join(lines)


COMPARE_METRICS = [
    ("req/s", lambda r: r["throughput"]["requests_per_s"]),
    ("out tok/s", lambda r: r["throughput"]["output_tokens_per_s"]),
    ("goodput", lambda r: r["throughput"]["goodput_requests_per_s"]),
    ("TTFT p50 ms", lambda r: _x1000(r["latency_s"]["ttft"]["p50"])),
    ("TTFT p95 ms", lambda r: _x1000(r["latency_s"]["ttft"]["p95"])),
    ("TPOT p50 ms", lambda r: _x1000(r["latency_s"]["tpot"]["p50"])),
    ("TPOT p95 ms", lambda r: _x1000(r["latency_s"]["tpot"]["p95"])),
    ("e2e p95 ms", lambda r: _x1000(r["latency_s"]["e2e"]["p95"])),
    ("completed", lambda r: r["requests"]["completed"]),
]


def _x1000(x):
    return None if x is None else x * 1e3


def _same_workload(wa: dict, wb: dict) -> bool:
    ignore = {"rate", "time_scale", "pattern_rate"}
    return {k: v for k, v in wa.items() if k not in ignore} == {k: v for k, v in wb.items() if k not in ignore}
