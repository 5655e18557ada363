"""ONNX / TensorRT backend benchmark (not a test): build times, and decode step time of the onnx engine
(onnxruntime, CPU) against the cpu and cpu-compiled engines, all in one run on the ~300M Llama.

    .venv/bin/python scripts/bench_onnx.py [--steps 20] [--threads 2] [--variants fp32,int8] [--skip-compiled]

Engines (fp32 unless --variants): cpu, cpu-compiled (AOTInductor, minutes to build), onnx, and a tensorrt
plan (built by tensorrt_rtx without a GPU: only its build time is measured). Decode steps: batch 1 and 16,
every sequence with 128 tokens of context (scripts/bench_build.py's harness), median of --steps steps, the
engines taking turns step by step so that the shared machine's load falls on all of them alike. Last, the
cost of the KV pool as an onnx output: the same step with ``kv_cache_out`` bound to a separate buffer
(onnxruntime then copies the whole pool each step) vs bound to the input's own buffer (kiln's runtime),
for pools of 1 and 4 GiB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from bench_build import CONTEXT, VARIANTS, decode_inputs
from bench_common import BENCH, ensure_checkpoint, log

BACKENDS = ("cpu", "cpu-compiled", "onnx", "tensorrt")


def build_config(variant: str, backend: str):
    from kiln.builder import BuildConfig

    return BuildConfig(max_batch_size=16, max_input_len=256, max_seq_len=512, max_num_tokens=256,
                       tokens_per_block=16, backend=backend, **VARIANTS[variant],
                       **({"num_tokens_profiles": [16, 256]} if backend == "tensorrt" else {}))


def pool_copy_cost(engine, sizes_gib=(1, 4), repeat: int = 5) -> list[tuple[float, float, float]]:
    """(pool GiB, ms per step with the pool output bound to the input, ms with a separate output)."""
    from kiln.contract import INPUT_NAMES, KV_CACHE_OUTPUT, OUTPUT_NAME

    runner = engine._fn
    out = []
    for gib in sizes_gib:
        blocks = int(gib * (1 << 30) // (engine.kv_bytes_per_token * engine.config.bounds.tokens_per_block))
        inputs = decode_inputs(engine, 1)
        kv = engine.allocate_kv_cache(blocks)
        inputs["kv_cache"] = kv
        row = [gib]
        for separate in (False, True):
            target = torch.empty_like(kv) if separate else kv
            binding = runner.session.io_binding()
            for name in INPUT_NAMES:
                t = inputs[name]
                binding.bind_input(name, "cpu", 0, t.numpy().dtype, list(t.shape), t.data_ptr())
            binding.bind_output(KV_CACHE_OUTPUT, "cpu", 0, np.float32, list(kv.shape), target.data_ptr())
            binding.bind_output(OUTPUT_NAME, "cpu")
            runner.session.run_with_iobinding(binding)
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                runner.session.run_with_iobinding(binding)
                times.append(time.perf_counter() - t0)
            row.append(statistics.median(times) * 1e3)
            target = None
        out.append(tuple(row))
        kv = inputs = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="fp32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-compiled", action="store_true", help="leave out cpu-compiled (its build takes minutes)")
    ap.add_argument("--reuse", action="store_true", help="reuse the engines of an earlier run (no build times)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kiln.builder import build_engine
    from kiln.runtime import Engine

    ckpt = ensure_checkpoint("300m")
    backends = [b for b in BACKENDS if not (args.skip_compiled and b == "cpu-compiled")]
    reports, engines = {}, {}
    for v in args.variants.split(","):
        for b in backends:
            out = BENCH / f"engine-onnxbench-{v}-{b}"
            if not (args.reuse and (out / "build_report.json").is_file()):
                log(f"build {v} {b} ...")
                build_engine(ckpt, out, build_config(v, b))
            reports[v, b] = json.loads((out / "build_report.json").read_text())
            if b != "tensorrt":
                engines[v, b] = out
    print()
    print("build time (s): total | compile stage (onnx: export + fold + save + check; tensorrt: the same export, "
          "then TensorRT's parse + build)")
    for (v, b), r in reports.items():
        extra = r["backend"]
        detail = f", TensorRT build {extra['build_s']:.1f} s, plan {extra['plan_bytes'] / 1e6:.0f} MB" \
            if b == "tensorrt" else f", onnx file {extra['file_bytes'] / 1e6:.0f} MB" if b == "onnx" else ""
        print(f"  {v:<5} {b:<13} {r['timings_s']['total']:7.1f} | {r['timings_s']['compile']:6.1f}{detail}")

    rows = []
    for v in args.variants.split(","):
        loaded = {b: Engine.from_dir(engines[v, b]) for b in backends if (v, b) in engines}
        for batch in (1, 16):
            inputs = {b: decode_inputs(e, batch) for b, e in loaded.items()}
            times: dict[str, list[float]] = {b: [] for b in loaded}
            for b, e in loaded.items():
                e.run(inputs[b])
            for _ in range(args.steps):   # round robin: the machine's load falls on every engine alike
                for b, e in loaded.items():
                    t0 = time.perf_counter()
                    e.run(inputs[b])
                    times[b].append(time.perf_counter() - t0)
            med = {b: statistics.median(t) * 1e3 for b, t in times.items()}
            rows.append((v, batch, med))
        if "onnx" in loaded:
            copy = pool_copy_cost(loaded["onnx"])
        loaded = inputs = None
    print()
    print(f"decode step ms (median of {args.steps}), context {CONTEXT}, {args.threads} threads, same run; "
          "ratio = onnx / engine")
    print(f"  {'variant':<7} {'batch':>5} " + " ".join(f"{b:>13}" for b in backends if b != "tensorrt")
          + "   onnx/cpu  onnx/cpu-compiled")
    for v, batch, med in rows:
        ratio = " ".join(f"{med['onnx'] / med[b]:>9.2f}" if b in med else f"{'-':>9}"
                         for b in ("cpu", "cpu-compiled"))
        print(f"  {v:<7} {batch:>5} " + " ".join(f"{med.get(b, float('nan')):>13.1f}" for b in backends
                                                   if b != "tensorrt") + f"   {ratio}")
    print()
    print("onnx decode step (batch 1) with the pool output bound to the input (in place) vs a separate buffer:")
    for gib, same, separate in copy:
        print(f"  pool {gib} GiB: in place {same:.1f} ms, separate output {separate:.1f} ms "
              f"(+{separate - same:.1f} ms)")


if __name__ == "__main__":
    sys.exit(main())
