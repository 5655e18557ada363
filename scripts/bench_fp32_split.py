"""fp32-x GEMMs on the split-bf16 AMX routes against kiln's kernels (not a test).

    .venv/bin/python scripts/bench_fp32_split.py [--weights fp32|int8] [--shapes 2048x1536x1024,...] [--rounds 7]

``--weights fp32``: fp32 panels, the split route (``KILN_FP32_MATMUL=high``: x and the weights as bf16 halves) against
the fp32 kernels. ``--weights int8``: int8 panels (per-output scales), the tile route with x split into bf16 halves
(on by default from 64 rows) against the int8 kernels (``set_bf16_gemm_m(0)``). For each M x N x K (rows of x,
outputs, inputs; default: the 246M Llama's prefill shapes at 64-2048 rows) both routes run alternately in one process;
prints the median ms and GFLOP/s of each, their ratio, and each one's error against the float64 product (max and
mean, over the mean |y|). Needs a CPU with AMX-BF16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln.plugins import linear
from kiln.plugins.native import cpu_flags
from kiln.plugins.weight_format import pack_panels, quantize_int8

DEFAULT = "64x1536x1024,128x1536x1024,512x1536x1024,2048x1536x1024,2048x1024x1024,2048x5632x1024,2048x1024x2816"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", choices=("fp32", "int8"), default="fp32")
    ap.add_argument("--shapes", default=DEFAULT, help="comma-separated MxNxK")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if "amx_bf16" not in cpu_flags():
        raise SystemExit("this CPU has no AMX-BF16: the split-bf16 routes do not exist here")
    torch.manual_seed(0)
    int8 = args.weights == "int8"
    # each route's switch: the split route from 1 row (split) or off (kernels)
    setter = linear.set_bf16_gemm_m if int8 else linear.set_fp32_gemm_m
    old = linear.bf16_gemm_m() if int8 else linear.fp32_gemm_m()
    on = old if int8 else 1
    print(f"{'M x N x K':>18} {'split ms':>9} {'GF/s':>6} {'kernels':>9} {'GF/s':>6} {'ratio':>6}  "
          f"error/mean|y|: split max, mean; {args.weights} kernels max, mean")
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        w, x, b = torch.randn(n, k) * 0.02, torch.randn(m, k), torch.randn(n)
        if int8:
            q, scales = quantize_int8(w)
            panels, wq = pack_panels(q), q.double() * scales.double()[:, None]

            def run():
                return linear.weight_only_linear(x, panels, scales, b, bits=8)
        else:
            panels, wq = pack_panels(w), w.double()

            def run():
                return linear.fp32_linear(x, panels, b)
        exact = x.double() @ wq.T + b.double()
        times: dict[bool, list[float]] = {True: [], False: []}
        errors = {}
        for _ in range(args.rounds):
            for split in (True, False):
                setter(on if split else 0)
                t = time.perf_counter()
                y = run()
                times[split].append(time.perf_counter() - t)
                d = (y.double() - exact).abs() / exact.abs().mean()
                errors[split] = (d.max().item(), d.mean().item())
        split, kernels = statistics.median(times[True]), statistics.median(times[False])
        flops = 2 * m * n * k
        err = f"{errors[True][0]:.1e}, {errors[True][1]:.1e}; {errors[False][0]:.1e}, {errors[False][1]:.1e}"
        print(f"{shape:>18} {split * 1e3:9.2f} {flops / split / 1e9:6.0f} {kernels * 1e3:9.2f} "
              f"{flops / kernels / 1e9:6.0f} {kernels / split:6.2f}  {err}")
    setter(old)


if __name__ == "__main__":
    main()
