"""A decode step's linears alone, per weight format, against the read rate (not a test).

    .venv/bin/python scripts/bench_linear_pass.py [--formats fp32,bf16,int8,int4g32,int4g64,int4g128] [--m 1,16]
                                                  [--rounds 5] [--threads 2] [--tunings "a:name=v,...;b:..."]

The 246m Llama's linears (16 layers of qkv 1536x1024, o 1024x1024, gate_up 5632x1024, down 1024x2816, then the
LM head 32000x1024; random weights in the layouts the builder stores: panels) are called one after the other as a
decode step calls them, so each weight comes from memory once per pass. Per format: the pass's time (best and
median of ``--rounds``) and its bytes / time as a share of the read rate measured by a 256 MiB streaming read
right before each pass (``kiln_stream_sum``); per shape, GB/s of the weights at that shape over the pass, and the
fixed cost of one call (the smallest shape, 1024x1024, called on one weight that stays in cache: per-call
overhead plus compute). bench_kernels.py times single calls; this is the sum a decode step pays.

``--tunings`` compares kernel tunables (``kiln.plugins.tuning``, as ``bench_tunables.py`` takes them) on the same
weights instead: every round runs each variant's pass (the median of 5, after one untimed), the variants set on top
of the machine's tuning in turn (``bench_tunables.compare_variants``), and prints per variant the median GB/s of the
pass and the paired ratio to the first variant in the same round (> 1: faster). Alternating in one process keeps the
VM's drift and where the weights landed in memory alike for all variants.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_common import stream_read_rate
from bench_tunables import compare_variants, parse_variants, print_paired

LAYERS = 16
SHAPES = {"qkv": (1536, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)}
LM_HEAD = (32000, 1024)


def make_weight(fmt: str, n: int, k: int):
    """(call(x) -> y, bytes read per call) for a random weight of ``fmt`` in the builder's layout."""
    from kiln.plugins import linear
    from kiln.plugins import weight_format as wf

    w = torch.randn(n, k) * 0.02
    if fmt == "fp32":
        p = wf.pack_panels(w)
        return (lambda x: linear.fp32_linear(x, p)), p.numel() * 4
    if fmt == "bf16":
        p = wf.pack_panels(w.bfloat16())
        return (lambda x: linear.bf16_linear(x, p)), p.numel() * 2
    if fmt == "int8":
        q, s = wf.quantize_int8(w)
        p = wf.pack_panels(q)
        return (lambda x: linear.weight_only_linear(x, p, s, None, 8, 0)), p.numel() + s.numel() * 4
    if fmt.startswith("int4g"):
        gs = int(fmt[5:])
        q = wf.quantize_int4_panels(w, gs)
        return (lambda x: linear.weight_only_linear(x, q.qweight, q.scales, None, 4, gs)), \
            q.qweight.numel() + q.scales.numel() * 2
    raise SystemExit(f"unknown format {fmt!r}: fp32, bf16, int8 or int4g<group size>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="fp32,bf16,int8,int4g32,int4g64,int4g128")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tunings", default="", help="variants 'label:name=value,...;label:...' to alternate")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kiln.plugins import native, tuning

    lib = native.library()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"cpu: {cpu}, {args.threads} threads, panel isa {native.panel_isa()}, tuning {tuning.current(lib)}")
    read_buf = torch.ones(1 << 26)
    if not args.tunings:
        print(f"{'format':<9} {'M':>3} {'MB/pass':>8} {'best ms':>8} {'med ms':>8} {'read GB/s':>9} {'% read':>7} "
              f"{'best %':>7} | GB/s per shape over the pass (qkv o gate_up down lm_head) | 1024x1024 in-cache us")
    for fmt in args.formats.split(","):
        torch.manual_seed(0)
        layers = [{name: make_weight(fmt, *shape) for name, shape in SHAPES.items()} for _ in range(LAYERS)]
        head = make_weight(fmt, *LM_HEAD)
        total = sum(b for layer in layers for _, b in layer.values()) + head[1]
        for m in (int(v) for v in args.m.split(",")):
            xs = {k: torch.randn(m, k) for k in (1024, 2816)}
            per = {name: 0.0 for name in [*SHAPES, "lm_head"]}

            def one_pass(timed: bool) -> float:
                t0 = time.perf_counter()
                for layer in layers:
                    for name, (fn, _) in layer.items():
                        t = time.perf_counter()
                        fn(xs[SHAPES[name][1]])
                        if timed:
                            per[name] += time.perf_counter() - t
                t = time.perf_counter()
                head[0](xs[1024])
                if timed:
                    per["lm_head"] += time.perf_counter() - t
                return time.perf_counter() - t0

            one_pass(False)
            if args.tunings:
                def gb_s() -> float:
                    one_pass(False)
                    return total / statistics.median(one_pass(False) for _ in range(5)) / 1e9

                print(f"{fmt} M={m}: GB/s of the pass")
                print_paired(compare_variants(lib, parse_variants(args.tunings), args.rounds, gb_s), "GB/s")
                continue
            times, pcts = [], []
            for _ in range(args.rounds):
                rate = stream_read_rate(read_buf)
                sec = one_pass(True)
                times.append(sec)
                pcts.append(100 * total / sec / (rate * 1e9))
            rate = stream_read_rate(read_buf)
            shape_gbs = []
            for name in [*SHAPES, "lm_head"]:
                nbytes = head[1] if name == "lm_head" else sum(layer[name][1] for layer in layers)
                shape_gbs.append(nbytes * args.rounds / per[name] / 1e9)
            fn0 = layers[0]["o"][0]
            x0 = xs[1024]
            for _ in range(20):
                fn0(x0)
            t0 = time.perf_counter()
            for _ in range(200):
                fn0(x0)
            us = (time.perf_counter() - t0) / 200 * 1e6
            best, med = min(times), statistics.median(times)
            print(f"{fmt:<9} {m:>3} {total / 1e6:8.1f} {best * 1e3:8.2f} {med * 1e3:8.2f} {rate:9.1f} "
                  f"{statistics.median(pcts):6.0f}% {max(pcts):6.0f}% | "
                  + " ".join(f"{g:5.1f}" for g in shape_gbs) + f" | {us:6.1f}", flush=True)
        layers = head = None


if __name__ == "__main__":
    main()
