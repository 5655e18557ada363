"""``kiln bench compare``: one workload against several servers (kiln, vLLM, ...), side by side.

Each target is an OpenAI-compatible endpoint, named ``NAME=URL``. A target may be launched by the command itself
(``--launch NAME=COMMAND``): then the startup time (from the launch until ``/v1/models`` answers) and the idle RSS
(the server's whole process tree: vLLM runs three processes) are measured, and the server is stopped before the
next target starts, so that two servers never share the cores. For a server already running, ``--pid NAME=PID``
lets the idle RSS be read. Targets run one after another, each through the same sweep as ``kiln bench``.

The table gives, per rate, each metric of every target and its ratio to the first target's; the summary gives the
knee (the highest rate meeting the SLO), the goodput there and at the first target's knee, startup and idle RSS.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.bench.report import COMPARE_METRICS, _f, _rate, _same_workload, format_table


class CompareError(ValueError):
    """A target specification or a launched server is unusable; the message says which and how to fix it."""


@dataclass
class TargetSpec:
    """One endpoint of a comparison; ``command`` when compare launches it, ``pid`` to read its idle RSS."""

    name: str
    url: str
    command: list[str] | None = None
    pid: int | None = None


def _named(text: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise CompareError(f"{what} {text!r}: write NAME=VALUE (e.g. kiln=http://127.0.0.1:8000)")
    return name.strip(), value.strip()


def parse_targets(targets: tuple[str, ...], launches: tuple[str, ...] = (), pids: tuple[str, ...] = ()
                  ) -> list[TargetSpec]:
    """``--target NAME=URL`` (in order), ``--launch NAME=COMMAND`` and ``--pid NAME=PID`` joined by name."""
    specs: dict[str, TargetSpec] = {}
    for t in targets:
        name, url = _named(t, "--target")
        if name in specs:
            raise CompareError(f"--target {name!r} is given twice; give each target a distinct name")
        if not url.startswith(("http://", "https://")):
            raise CompareError(f"--target {t!r}: the URL must start with http:// or https://")
        specs[name] = TargetSpec(name, url.rstrip("/"))
    if not specs:
        raise CompareError("compare needs a --target NAME=URL (two or more for a side-by-side; one runs alone and "
                           "its result.json compares later: kiln bench compare A/result.json B/result.json)")
    for option, items in (("--launch", launches), ("--pid", pids)):
        for item in items:
            name, value = _named(item, option)
            if name not in specs:
                raise CompareError(f"{option} {name!r}: no --target of that name (targets: {', '.join(specs)})")
            if option == "--launch":
                specs[name].command = shlex.split(value)
            else:
                try:
                    specs[name].pid = int(value)
                except ValueError:
                    raise CompareError(f"--pid {item!r}: the PID must be an integer") from None
    for s in specs.values():
        if s.command and s.pid:
            raise CompareError(f"target {s.name!r}: give --launch or --pid, not both (a launched server's pid is "
                               "known)")
    return list(specs.values())


# ---- servers compare launches ---------------------------------------------------------------------------------
def launch(spec: TargetSpec, timeout: float, log_path: Path) -> tuple[subprocess.Popen, float]:
    """Start ``spec.command`` in its own session, wait until ``URL/v1/models`` answers 200; (process, seconds)."""
    import httpx

    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")   # noqa: SIM115 - the server writes it for as long as it runs
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(spec.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        log.close()
        raise CompareError(f"--launch {spec.name}: cannot start {spec.command[0]!r} ({exc})") from None
    log.close()
    with httpx.Client(timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                raise CompareError(f"--launch {spec.name}: the server exited with status {proc.returncode} before "
                                   f"{spec.url}/v1/models answered; see {log_path}")
            try:
                if client.get(f"{spec.url}/v1/models").status_code == 200:
                    return proc, time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > timeout:
                stop(proc)
                raise CompareError(f"--launch {spec.name}: {spec.url}/v1/models did not answer within {timeout:g} s "
                                   f"(raise --startup-timeout, or check the URL's port); see {log_path}")
            time.sleep(0.2)


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the server's process group (its workers too), SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def tree_rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` and all its descendants (Linux /proc); None where it cannot be read."""
    def children() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            out.setdefault(ppid, []).append(int(d.name))
        return out

    def rss(p: int) -> int:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    if not Path(f"/proc/{pid}").exists():
        return None
    kids, total, todo = children(), 0, [pid]
    while todo:
        p = todo.pop()
        total += rss(p)
        todo += kids.get(p, [])
    return total


# ---- the side-by-side -----------------------------------------------------------------------------------------
def knee_goodput(result: dict) -> tuple[float | None, float | None]:
    """(knee rate, goodput at that rate) of a result; (None, None) when no rate met the SLO."""
    knee = result["summary"].get("knee_rate")
    run = next((r for r in result["runs"] if r["rate"] == knee), None)
    return knee, (None if run is None else run["throughput"]["goodput_requests_per_s"])


def _goodput_at(result: dict, rate) -> float | None:
    run = next((r for r in result["runs"] if r["rate"] == rate), None)
    return None if run is None else run["throughput"]["goodput_requests_per_s"]


def _ratio(v, base) -> str:
    return "-" if v is None or base in (None, 0) else f"x{v / base:.2f}"


def summary_rows(results: dict[str, dict], extras: dict[str, dict]) -> list[list[str]]:
    """Per target: knee, goodput at its knee and at the first target's, best goodput, startup, idle RSS; each
    with its ratio to the first target."""
    names = list(results)
    base = names[0]
    base_knee, _ = knee_goodput(results[base])
    facts = {}
    for n in names:
        knee, good = knee_goodput(results[n])
        best = max((r["throughput"]["goodput_requests_per_s"] for r in results[n]["runs"]), default=None)
        rss = extras.get(n, {}).get("idle_rss_bytes")
        facts[n] = {"knee rate": knee, "goodput at own knee": good,
                    f"goodput at {base}'s knee": _goodput_at(results[n], base_knee),
                    "best goodput": best, "startup s": extras.get(n, {}).get("startup_s"),
                    "idle RSS MiB": None if rss is None else rss / 2**20}
    rows = []
    for metric in facts[base]:
        cells = [metric]
        for n in names:
            v = facts[n][metric]
            cells.append(_f(v, ".3g") + ("" if n == base else f" ({_ratio(v, facts[base][metric])})"))
        rows.append(cells)
    return rows


def rate_table(results: dict[str, dict]) -> list[list[str]]:
    """Per rate the first target ran (and every other ran too), each metric of every target with its ratio."""
    names = list(results)
    base = names[0]
    by_rate = {n: {str(r["rate"]): r for r in results[n]["runs"]} for n in names}
    rows = []
    for run in results[base]["runs"]:
        key = str(run["rate"])
        if not all(key in by_rate[n] for n in names):
            continue
        for metric, get in COMPARE_METRICS:
            vb = get(run)
            cells = [_rate(run["rate"]), metric, _f(vb, ".3g")]
            for n in names[1:]:
                v = get(by_rate[n][key])
                cells.append(f"{_f(v, '.3g')} ({_ratio(v, vb)})")
            rows.append(cells)
    return rows


def format_comparison(results: dict[str, dict], extras: dict[str, dict]) -> str:
    """The side-by-side text: targets, the summary (knee, goodput, startup, RSS) and the rate table."""
    names = list(results)
    head = [f"{n}: {results[n]['config'].get('target')}" for n in names]
    head.append(f"ratios are each target / {names[0]}; SLO {results[names[0]]['config']['slo']}")
    w0 = results[names[0]]["config"]["workload"]
    head += [f"NOTE: {n} ran a different workload: {results[n]['config']['workload']} (vs {w0})"
             for n in names[1:] if not _same_workload(w0, results[n]["config"]["workload"])]
    rows = rate_table(results)
    parts = [*head, format_table(["summary", *names], summary_rows(results, extras))]
    parts.append(format_table(["rate", "metric", *names], rows) if rows else
                 "no rate that every target ran: " + "; ".join(
                     f"{n} {[r['rate'] for r in results[n]['runs']]}" for n in names))
    return "\n".join(parts)


def write_comparison_plot(results: dict[str, dict], path: Path) -> Path:
    """compare.png: goodput, TTFT p50/p95 and TPOT p95 against the offered rate, one line per target."""
    from kiln.bench.plots import _finite_runs, _plt

    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    slo = next(iter(results.values()))["config"]["slo"]
    for name, result in results.items():
        runs = _finite_runs(result)
        rates = [r["rate"] for r in runs]
        axes[0].plot(rates, [r["throughput"]["goodput_requests_per_s"] for r in runs], "o-", label=name)
        for q, style in (("p50", "o-"), ("p95", "s--")):
            axes[1].plot(rates, [_ms(r["latency_s"]["ttft"][q]) for r in runs], style, label=f"{name} {q}")
        axes[2].plot(rates, [_ms(r["latency_s"]["tpot"]["p95"]) for r in runs], "s-", label=f"{name} p95")
    for ax, title, limit in ((axes[0], "goodput (req/s)", None), (axes[1], "TTFT (ms)", slo.get("ttft_p95_s")),
                             (axes[2], "TPOT (ms)", slo.get("tpot_p95_s"))):
        if limit:
            ax.axhline(limit * 1e3, color="grey", linestyle=":", label="SLO p95")
        ax.set_title(title)
        ax.set_xlabel("offered rate (req/s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _ms(x):
    return math.nan if x is None else x * 1e3
