"""Serving capacity benchmark (not a test): the planner's prediction next to a measured rate sweep.

    .venv/bin/python scripts/bench_serving.py [--rates 0.25,0.5,1,2] [--requests 40] [--prompt-scale 0.05]

A ~300M-parameter random Llama (``work/bench/llama-300m``, shared with the other benchmarks) is built into
an int8 weight-only ``cpu`` engine (batch 16, prompts <= 512, sequences <= 640 tokens). The Azure code trace
(``../shared/traces/azure_llm_2023_code.csv``) is scaled to this 2-core CPU: prompt lengths x --prompt-scale,
outputs as recorded, both clipped to the engine's bounds, the first --requests requests, arrivals time-scaled
to each rate of the sweep. Everything runs through the ``kiln`` command, and each command is printed:

1. calibration: ``kiln bench --max-throughput`` on 24 requests (steps of every size; the step-time fit gives
   this machine's effective bandwidth and FLOP/s);
2. prediction: ``kiln plan --device cpu:24 --calibration ...`` on the same workload;
3. measurement: ``kiln bench --rates ...``;
4. the planner's queueing onset (concurrency and rate) next to the sweep's.

Outputs under ``work/bench/serving/``: result.json files, PNG plots, plan.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench_common import BENCH, ensure_checkpoint, ensure_engine, log

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent.parent / "shared" / "traces" / "azure_llm_2023_code.csv"
BUILD = dict(dtype="float32", quantization="int8_weight_only", backend="cpu", max_batch_size=16, max_input_len=512,
             max_seq_len=640, max_num_tokens=512, tokens_per_block=16)


def kiln(*args: str) -> None:
    cmd = [str(Path(sys.executable).parent / "kiln"), *args]
    log("$ kiln " + " ".join(shlex.quote(a) for a in args))
    subprocess.run(cmd, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--rates", default="0.25,0.5,1,2")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prompt-scale", type=float, default=0.05)
    ap.add_argument("--slo-ttft-p95", default="4s")
    ap.add_argument("--slo-tpot-p95", default="400ms")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=BENCH / "serving")
    ap.add_argument("--max-kv-cache-tokens", type=int, help="cap the KV pool (the same option for plan and bench)")
    ap.add_argument("--arrivals", choices=["trace", "poisson"], default="trace",
                    help="trace: the trace's own (bursty) arrivals; poisson: Poisson arrivals with lengths drawn "
                         "from the whole trace (the planner's mean-value model assumes smooth arrivals)")
    ap.add_argument("--skip-calibration", action="store_true", help="reuse OUT/calibration/result.json")
    args = ap.parse_args()

    ensure_checkpoint()
    engine = str(ensure_engine("engine-serving-int8-b16", BUILD))
    work = ["--trace", str(args.trace), "--prompt-scale", str(args.prompt_scale), "--output-scale", "1",
            "--clip-to-engine"]
    serving = ["--max-kv-cache-tokens", str(args.max_kv_cache_tokens)] if args.max_kv_cache_tokens else []
    common = ["--engine", engine, *work, "--threads", str(args.threads), "--no-progress"]
    log(f"1-min load average before: {os.getloadavg()[0]:.2f}")
    cal = args.out / "calibration"
    if not args.skip_calibration:
        kiln("bench", *common, "--max-requests", "24", "--max-throughput", "--output", str(cal), "--no-plots")
    plan_json = args.out / "plan.json"
    poisson = args.arrivals == "poisson"
    lengths = ["--prompt-len", "trace", "--output-len", "trace"] if poisson else []
    window = [] if poisson else ["--max-requests", str(args.requests)]   # Poisson mode samples the whole trace
    kiln("plan", "--engine", engine, "--device", "cpu:24", *work, *window,
         "--calibration", str(cal / "result.json"), "--ttft-p95", args.slo_ttft_p95, "--tpot-p95", args.slo_tpot_p95,
         *serving, "--kv-cache-memory-fraction", "0.9", "--output", str(plan_json))
    sweep = args.out / "sweep"
    t0 = time.time()
    kiln("bench", *common, *serving, *lengths, "--max-requests", str(args.requests), "--rates", args.rates,
         "--slo-ttft-p95",
         args.slo_ttft_p95, "--slo-tpot-p95", args.slo_tpot_p95, "--output", str(sweep))
    log(f"sweep took {time.time() - t0:.0f} s; 1-min load average after: {os.getloadavg()[0]:.2f}")

    full_plan = json.loads(plan_json.read_text())["plan"]
    plan = full_plan["load"]
    res = json.loads((sweep / "result.json").read_text())
    onset = res["summary"]["queueing_onset"]
    print()
    print(f"planner: queueing starts at {plan['queueing_onset_concurrency']['value']:.1f} concurrent sequences, "
          f"{plan['queueing_onset_rate']['value']:.3g} req/s (saturation {plan['saturation_rate']['value']:.3g} req/s)")
    if onset is None:
        print("measured: no rate of the sweep showed queueing or preemption; extend --rates")
        return 0
    c_meas = onset["running_while_waiting"] or onset["running_max"]
    c_pred = plan["queueing_onset_concurrency"]["value"]
    print(f"measured: queueing first shows at {onset['rate']:g} req/s with {c_meas:.1f} sequences running while "
          f"requests waited (max {onset['running_max']}), waiting {onset['waiting_time_fraction']:.0%} of the time, "
          f"{onset['preemptions']:.0f} preemptions")
    print(f"concurrency: measured / predicted = {c_meas / c_pred:.2f} (target within 25%)")
    conc = full_plan["concurrency"]
    print("planner's KV-limited sequences at P50/P90/P95 lengths: " + ", ".join(
        f"{conc[f'kv_sequences_at_{q}']['value']}" for q in ("p50", "p90", "p95"))
        + f"; at mean occupancy {conc['kv_sequences_at_mean_occupancy']['value']:.1f}; guaranteed "
        f"{conc['max_concurrent_sequences']['value']} (limited by {conc['limited_by']['value']})")
    rates = [r["rate"] for r in res["runs"]]
    below = [r for r in rates if r < onset["rate"]]
    print(f"onset rate: predicted {plan['queueing_onset_rate']['value']:.3g} req/s; measured between "
          f"{max(below) if below else 0:g} and {onset['rate']:g} req/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
