"""fp32 GEMMs on fp32 panels: the split-bf16 AMX route (``KILN_FP32_MATMUL=high``) against kiln's fp32 kernels
(not a test).

    .venv/bin/python scripts/bench_fp32_split.py [--shapes 2048x1536x1024,...] [--rounds 7]

For each M x N x K (rows of x, outputs, inputs; default: the 246M Llama's prefill shapes at 64-2048 rows) both
routes run alternately in one process (``linear.set_fp32_gemm_m``); prints the median ms and GFLOP/s of each, their
ratio, and each one's error against the float64 product (max and mean, over the mean |y|). Needs a CPU with AMX-BF16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln.plugins import linear
from kiln.plugins.native import cpu_flags
from kiln.plugins.weight_format import pack_panels

DEFAULT = "64x1536x1024,128x1536x1024,512x1536x1024,2048x1536x1024,2048x1024x1024,2048x5632x1024,2048x1024x2816"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT, help="comma-separated MxNxK")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if "amx_bf16" not in cpu_flags():
        raise SystemExit("this CPU has no AMX-BF16: the split-bf16 route does not exist here")
    torch.manual_seed(0)
    old = linear.fp32_gemm_m()
    print(f"{'M x N x K':>18} {'split ms':>9} {'GF/s':>6} {'fp32 ms':>9} {'GF/s':>6} {'ratio':>6}  "
          "error/mean|y|: split max, mean; fp32 max, mean")
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        w, x, b = torch.randn(n, k) * 0.02, torch.randn(m, k), torch.randn(n)
        panels = pack_panels(w)
        exact = x.double() @ w.double().T + b.double()
        times: dict[int, list[float]] = {1: [], 0: []}
        errors = {}
        for _ in range(args.rounds):
            for route in (1, 0):
                linear.set_fp32_gemm_m(route)
                t = time.perf_counter()
                y = linear.fp32_linear(x, panels, b)
                times[route].append(time.perf_counter() - t)
                d = (y.double() - exact).abs() / exact.abs().mean()
                errors[route] = (d.max().item(), d.mean().item())
        split, kernels = statistics.median(times[1]), statistics.median(times[0])
        flops = 2 * m * n * k
        err = f"{errors[1][0]:.1e}, {errors[1][1]:.1e}; {errors[0][0]:.1e}, {errors[0][1]:.1e}"
        print(f"{shape:>18} {split * 1e3:9.2f} {flops / split / 1e9:6.0f} {kernels * 1e3:9.2f} "
              f"{flops / kernels / 1e9:6.0f} {kernels / split:6.2f}  {err}")
    linear.set_fp32_gemm_m(old)


if __name__ == "__main__":
    main()
