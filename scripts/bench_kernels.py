"""Benchmark kiln's CPU linear kernels against torch on decode-like shapes.

Prints, per shape and M (tokens): time per call and GB/s of *weights* streamed (weight bytes /
time; activations are negligible at small M), plus GFLOP/s. Compare ratios within one run: other
processes on the machine add noise, so each case keeps the best of several repeats.

kiln's kernels read the weights in the layout the builder stores (panels of 16 rows where the shape
allows); "plain rows" is the [out, in] layout. By default a case calls one weight over and over, so a
weight that fits the caches is read from them; ``--from-memory`` hands each call the next of enough
copies to overflow the last-level cache, as a decode step reads every layer's weights from memory once.

    .venv/bin/python scripts/bench_kernels.py [--shapes 4096x5504,1024x2816] [--m 1,16] [--threads N]
                                              [--from-memory] [--only bf16]

"kiln bf16_linear (x bf16)" is what a bf16 engine runs: from ``linear.bf16_gemm_m()`` rows (AMX CPUs) oneDNN bf16
GEMMs on the panels in place; "(x bf16, panel kernels)" forces kiln's panel kernels at every M for comparison.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import torch.nn.functional as F


def bench(fn, min_time: float = 0.3) -> tuple[float, float]:
    """(best, median) seconds of single calls over about `min_time` seconds.

    The best call is the machine's capability; the median shows how much the other processes on
    the 2 shared cores disturbed this run (a 2-thread call waits for a preempted thread).
    """
    fn()
    times = []
    end = time.perf_counter() + min_time
    while len(times) < 5 or (time.perf_counter() < end and len(times) < 2000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[0], times[len(times) // 2]


def rotation(t: torch.Tensor, nbytes: int):
    """A callable returning, in turn, ``t`` and copies of it, together at least ``nbytes``."""
    copies = [t] + [t.clone() for _ in range(-(-nbytes // (t.numel() * t.element_size())) - 1)]
    if len(copies) == 1:
        return lambda: t
    it = itertools.cycle(copies)
    return lambda: next(it)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x5504,1024x2816", help="comma list of OUTxIN weight shapes")
    ap.add_argument("--m", default="1,16", help="comma list of token counts")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--min-time", type=float, default=0.4, help="seconds per case")
    ap.add_argument("--from-memory", action="store_true",
                    help="each call reads the next of copies of the weight totalling 256 MiB (not the caches)")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this (e.g. bf16)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from kiln.plugins import linear, native
    from kiln.plugins import weight_format as fmt

    from bench_common import stream_read_bandwidth

    def panel_kernels_only(x, w):
        old = linear.set_bf16_gemm_m(0)
        try:
            return linear.bf16_linear(x, w)
        finally:
            linear.set_bf16_gemm_m(old)

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    t0 = time.perf_counter()
    ok = native.native_kernels_available()
    print(f"native kernels: {'ok' if ok else 'UNAVAILABLE (torch fallback)'} "
          f"(load/compile {time.perf_counter() - t0:.1f} s)", flush=True)
    int8pack = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    bw = stream_read_bandwidth()
    print(f"streaming read bandwidth ({torch.get_num_threads()} threads, best of 7 x 64 MiB): {bw:.1f} GB/s "
          f"-> '%bw' = GB/s(w) / this (the batch-1 bound; compute-bound kernels stay below it)", flush=True)

    header = (f"{'shape':>11} {'M':>3}  {'kernel':<30} {'best ms':>8} {'GB/s(w)':>8} {'GFLOP/s':>8}"
              f" {'%bw':>5} {'vs fp32':>8} {'median ms':>10}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        torch.manual_seed(0)
        w = torch.randn(n, k) * 0.02
        wb = w.bfloat16()
        q8, s8 = fmt.quantize_int8(w)
        q4, s4 = fmt.quantize_int4(w, args.group_size)
        p4 = fmt.quantize_int4_panels(w, args.group_size) if fmt.can_pack_int4_panels(n, k, args.group_size) else None
        # the builder stores fp32/bf16/int8 weights in panels where the shape allows
        pack = fmt.pack_panels if fmt.can_pack_panels(w) else (lambda t: t)
        copies_bytes = (256 << 20) if args.from_memory else 0
        W, WB, Q8, Q4 = (rotation(t, copies_bytes) for t in (w, wb, q8, q4))
        P4 = rotation(p4.qweight, copies_bytes) if p4 is not None else None
        WP, WBP, Q8P = (rotation(pack(t), copies_bytes) for t in (w, wb, q8))
        print(f"\n== weight {n}x{k} ({n * k / 1e6:.1f}M elements), int4 group {args.group_size}"
              f"{', from memory' if args.from_memory else ''}", flush=True)
        print(header, flush=True)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k)
            xb = x.bfloat16()
            cases = [
                ("F.linear fp32", 4 * n * k, lambda: F.linear(x, W())),
                ("kiln fp32_linear", 4 * n * k, lambda: linear.fp32_linear(x, WP())),
                ("kiln fp32_linear (plain rows)", 4 * n * k, lambda: linear.fp32_linear(x, W())),
                ("F.linear bf16", 2 * n * k, lambda: F.linear(xb, WB())),
                ("kiln bf16_linear (x fp32)", 2 * n * k, lambda: linear.bf16_linear(x, WBP())),
                ("kiln bf16_linear (x bf16)", 2 * n * k, lambda: linear.bf16_linear(xb, WBP())),
                ("kiln bf16 (x bf16, panel kernels)", 2 * n * k, lambda: panel_kernels_only(xb, WBP())),
                ("kiln bf16_linear (plain rows)", 2 * n * k, lambda: linear.bf16_linear(x, WB())),
            ]
            if int8pack is not None:
                cases.append(("torch _weight_int8pack_mm", n * k, lambda: int8pack(xb, Q8(), s8.bfloat16())))
            cases += [
                ("kiln int8 (x fp32)", n * k, lambda: linear.weight_only_linear(x, Q8P(), s8, None, 8, 0)),
                ("kiln int8 (x bf16)", n * k, lambda: linear.weight_only_linear(xb, Q8P(), s8, None, 8, 0)),
                ("kiln int8 (plain rows)", n * k, lambda: linear.weight_only_linear(x, Q8(), s8, None, 8, 0)),
                (f"kiln int4 g{args.group_size} (plain)", n * k // 2 + s4.numel() * 4,
                 lambda: linear.weight_only_linear(x, Q4(), s4, None, 4, args.group_size)),
            ]
            if P4 is not None:   # what the builder stores for int4
                cases += [(f"kiln int4 g{args.group_size} panels", n * k // 2 + p4.scales.numel() * 2,
                           lambda: linear.weight_only_linear(x, P4(), p4.scales, None, 4, args.group_size)),
                          (f"kiln int4 g{args.group_size} panels x bf16", n * k // 2 + p4.scales.numel() * 2,
                           lambda: linear.weight_only_linear(xb, P4(), p4.scales, None, 4, args.group_size))]
            ref_ms = None
            for name, nbytes, fn in (c for c in cases if args.only in c[0]):
                try:
                    sec, med = bench(fn, args.min_time)
                except Exception as e:  # keep going: one broken torch op must not hide the rest
                    print(f"{shape:>11} {m:>3}  {name:<30} failed: {type(e).__name__}: {e}", flush=True)
                    continue
                ms = sec * 1e3
                ref_ms = ref_ms or ms
                gbs = nbytes / sec / 1e9
                print(f"{shape:>11} {m:>3}  {name:<30} {ms:8.3f} {gbs:8.1f} "
                      f"{2 * m * n * k / sec / 1e9:8.1f} {100 * gbs / bw:5.0f} {'x%.2f' % (ref_ms / ms):>8} "
                      f"{med * 1e3:10.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
