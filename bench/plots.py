"""PNG plots of a kiln bench result (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite_runs(result: dict) -> list[dict]:
    return sorted((r for r in result["runs"] if isinstance(r["rate"], (int, float)) and math.isfinite(r["rate"])),
                  key=lambda r: r["rate"])


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    """latency_vs_rate.png, throughput_vs_rate.png, latency_cdf.png, kv_usage.png (KV usage, running/waiting
    sequences and the prefix-cache hit rate over time); returns the paths written."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    runs = _finite_runs(result)
    slo = result["config"]["slo"]
    knee_rate = result["summary"].get("knee_rate")
    if runs:
        rates = [r["rate"] for r in runs]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for ax, key, title, slo_v in ((axes[0], "ttft", "TTFT", slo["ttft_p95_s"]),
                                      (axes[1], "tpot", "TPOT", slo["tpot_p95_s"]),
                                      (axes[2], "e2e", "end-to-end latency", None)):
            for q, style in (("p50", "o-"), ("p95", "s-"), ("p99", "^--")):
                ys = [r["latency_s"][key][q] for r in runs]
                ax.plot(rates, [np.nan if y is None else y * 1e3 for y in ys], style, label=q)
            if slo_v is not None:
                ax.axhline(slo_v * 1e3, color="red", lw=1, ls=":", label=f"SLO p95 {slo_v * 1e3:g} ms")
            if knee_rate is not None:
                ax.axvline(knee_rate, color="green", lw=1, ls="--", label=f"knee {knee_rate:g} req/s")
            ax.set_xlabel("offered rate (req/s)")
            ax.set_ylabel(f"{title} (ms)")
            ax.set_title(f"{title} vs rate")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(_save(fig, plt, out_dir / "latency_vs_rate.png"))

        fig, ax = plt.subplots(figsize=(7, 4.2))
        ax.plot(rates, [r["throughput"]["requests_per_s"] for r in runs], "o-", label="completed req/s (whole run)")
        ax.plot(rates, [r["throughput"].get("completion_rate") or np.nan for r in runs], "x--",
                label="completion rate (first to last completion)")
        ax.plot(rates, [r["throughput"]["goodput_requests_per_s"] for r in runs], "s-",
                label="goodput (within SLO) req/s")
        ax.plot(rates, rates, color="gray", ls=":", label="offered")
        if knee_rate is not None:
            ax.axvline(knee_rate, color="green", lw=1, ls="--", label=f"knee {knee_rate:g} req/s")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("requests/s")
        ax2 = ax.twinx()
        ax2.plot(rates, [r["throughput"]["output_tokens_per_s"] for r in runs], "d--", color="tab:purple",
                 label="output tok/s")
        ax2.set_ylabel("output tokens/s", color="tab:purple")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
        ax.set_title("throughput and goodput vs rate")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(_save(fig, plt, out_dir / "throughput_vs_rate.png"))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for run in result["runs"]:
        for ax, key in ((axes[0], "ttft"), (axes[1], "tpot")):
            xs = np.sort([p[key] * 1e3 for p in run["per_request"] if p.get(key) is not None])
            if xs.size:
                ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, drawstyle="steps-post", label=f"{run['rate']} req/s")
    for ax, key, slo_v in ((axes[0], "TTFT", slo["ttft_p95_s"]), (axes[1], "TPOT", slo["tpot_p95_s"])):
        if slo_v is not None:
            ax.axvline(slo_v * 1e3, color="red", lw=1, ls=":", label="SLO")
        ax.axhline(0.95, color="gray", lw=0.8, ls=":")
        ax.set_xlabel(f"{key} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{key} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, plt, out_dir / "latency_cdf.png"))

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    any_series = False
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(result["runs"]):
        ts = [s for s in run["timeseries"] if s.get("kv_usage") is not None or s.get("running") is not None]
        if ts:
            any_series = True
            c = colors[i % len(colors)]
            t = [s["t"] for s in ts]
            if any(s.get("kv_usage") is not None for s in ts):
                axes[0].plot(t, [(s.get("kv_usage") or 0) * 100 for s in ts], lw=1, color=c, drawstyle="steps-post",
                             label=f"{run['rate']} req/s")
            axes[1].plot(t, [s.get("running") or 0 for s in ts], lw=1, color=c, drawstyle="steps-post",
                         label=f"running @ {run['rate']}")
            axes[1].plot(t, [s.get("waiting") or 0 for s in ts], lw=1, ls=":", color=c, drawstyle="steps-post",
                         label=f"waiting @ {run['rate']}")
            if any(s.get("prefix_hit_rate") is not None for s in ts):
                axes[2].plot(t, [(s.get("prefix_hit_rate") or 0) * 100 for s in ts], lw=1, color=c,
                             drawstyle="steps-post", label=f"{run['rate']} req/s")
    axes[0].set_ylabel("KV blocks used (%)")
    axes[0].set_title("KV cache usage over time" + ("" if any_series else " (the target exposes no KV metrics)"))
    axes[1].set_title("running (solid) and waiting (dotted) sequences")
    axes[1].set_ylabel("sequences")
    axes[2].set_ylabel("prefix hit rate (%)")
    axes[2].set_title("prefix-cache hit rate (share of prompt tokens found cached, since the server started)")
    axes[2].set_xlabel("time since the run started (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(_save(fig, plt, out_dir / "kv_usage.png"))
    return paths


def _save(fig, plt, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
