"""Builder benchmark (not a test): build time per stage and decode step time vs the memory-bandwidth bound.

    .venv/bin/python scripts/bench_build.py [--variants fp32,bf16,int8,int4] [--steps 20] [--threads 2] [--size 300m]

A ~300M-parameter random Llama (``work/bench/llama-300m``, created once, shared with the serving bench;
``--size 246m``: 16 layers instead of 22) is built into four engines (fp32, bf16, int8 and int4 weight-only),
each build printing its stages.
Memory bandwidth is measured in the same run (sum and copy of a 1 GiB tensor, a 2-thread fp32 GEMV
that streams a 90 MB matrix, and the plugin's multi-stream read loop). Then each engine runs decode
steps at batch 1 and 16 (every sequence with 128 tokens of context), each step followed by a 256 MiB
streaming read: the median step time is printed next to the time the bandwidth measured between the
same steps allows, streamed weights bytes / read rate (and, as "strict", the share of the bound at
the best read rate of the whole run). Bytes streamed per decode step are the memory plan's
(``memory.decode_read_bytes``: everything but the rows gathered from the embedding and rope tables).
Last, ``transformers`` greedy-decodes at batch 1 from the same checkpoint and context in fp32 and bf16:
the baseline of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_common import BENCH, engine_is_current, ensure_checkpoint, log, stream_read_bandwidth, stream_read_rate

VARIANTS = {
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "int8": dict(dtype="float32", quantization="int8_weight_only"),
    "int4": dict(dtype="float32", quantization="int4_weight_only", group_size=128),
}
# the same engines through AOTInductor (``--variants fp32-compiled,...``): minutes of compile per engine
VARIANTS.update({f"{k}-compiled": dict(v, backend="cpu-compiled") for k, v in list(VARIANTS.items())})
CONTEXT = 128


def _steal_ticks() -> int:
    """CPU time the hypervisor gave other machines (/proc/stat "steal", in clock ticks, all CPUs)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) if len(fields) > 8 else 0
    except OSError:
        return 0


def _interleaved(step, read, repeat: int) -> tuple[list[float], list[float], float]:
    """Seconds of ``repeat`` calls of ``step``, each followed by ``read()`` (a GB/s measurement),
    and the share of the CPUs' time stolen by the hypervisor meanwhile (a slow row with a high
    steal share was measured while other machines ran on these cores)."""
    step()
    times, rates = [], []
    s0, w0 = _steal_ticks(), time.perf_counter()
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        rates.append(read())
    ticks = os.sysconf("SC_CLK_TCK") * (time.perf_counter() - w0) * (os.cpu_count() or 1)
    return times, rates, (_steal_ticks() - s0) / ticks


def _median_time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth() -> dict[str, float]:
    """GB/s of: sum of 1 GiB, copy of 1 GiB (read + write), fp32 GEMV over a 90 MB matrix."""
    big = torch.ones(1 << 28)  # 1 GiB fp32
    out = torch.empty_like(big)
    gib = big.numel() * 4
    res = {
        "sum": gib / _median_time(lambda: big.sum(), 5) / 1e9,
        "copy": 2 * gib / _median_time(lambda: out.copy_(big), 5) / 1e9,
    }
    big = out = None  # free the 2 GiB (not `del`: the lambdas above name them)
    w = torch.randn(5632, 4000)  # 22.5M elements, 90 MB: bigger than any cache
    x = torch.randn(1, 4000)
    res["gemv"] = w.numel() * 4 / _median_time(lambda: torch.nn.functional.linear(x, w), 20) / 1e9
    try:  # the plugin library's multi-stream read loop: what a well-written GEMV can stream
        res["stream_read"] = stream_read_bandwidth(256 << 20)  # GB/s, best of 7
    except Exception as exc:  # noqa: BLE001 - optional measurement
        log(f"stream_read_bandwidth unavailable ({exc})")
    return res


def build_config(variant: str):
    from kiln.builder import BuildConfig

    return BuildConfig(max_batch_size=16, max_input_len=256, max_seq_len=512, max_num_tokens=256,
                       tokens_per_block=16, **VARIANTS[variant])


def engine_dir(variant: str, size: str = "300m") -> Path:
    return BENCH / (f"engine-builder-{variant}" if size == "300m" else f"engine-builder-{size}-{variant}")


def build(variant: str, ckpt: Path, size: str = "300m") -> Path:
    from kiln.builder import build_engine

    cfg = build_config(variant)
    out = engine_dir(variant, size)
    log(f"build {variant}: {cfg.dtype}, quantization {cfg.quantization}, backend {cfg.backend}")
    build_engine(ckpt, out, cfg, progress=lambda s, m: m != "start" and print(f"    {s:<12} {m}", flush=True))
    return out


def decode_inputs(engine, batch: int) -> dict[str, torch.Tensor]:
    """One decode step: ``batch`` sequences each with CONTEXT cached tokens + 1 new one."""
    from kiln.contract import SeqChunk, pack_inputs

    block = engine.config.bounds.tokens_per_block
    per_seq = (CONTEXT + 1 + block - 1) // block
    kv = engine.allocate_kv_cache(per_seq * batch)
    tokens = torch.randint(3, engine.config.model.vocab_size, (batch,)).tolist()
    chunks = [SeqChunk([tokens[i]], CONTEXT, range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    return pack_inputs(chunks, kv, block)


GEMM_OPS = ("aten::linear", "aten::mm", "aten::addmm", "kiln::weight_only_linear", "kiln::bf16_linear",
            "kiln::fp32_linear")


def hf_decode_tok_s(ckpt: Path, dtype: torch.dtype, new_tokens: int = 32) -> float:
    """Batch-1 greedy decode tokens/s of ``transformers`` on the same checkpoint at context CONTEXT
    (the baseline the step times are compared with in the same run; the prefill is timed apart)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, CONTEXT), generator=torch.Generator().manual_seed(0))

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0

    with torch.inference_mode():
        gen(4)
        prefill = min(gen(1) for _ in range(3))
        total = gen(new_tokens + 1)
    return new_tokens / (total - prefill)


def breakdown(engine, inputs, steps: int = 3) -> dict[str, float]:
    """ms per step in GEMMs, in paged attention and in everything else (top-level ops, torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    engine.run(inputs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.run(inputs)
    out = {"gemm": 0.0, "attention": 0.0, "other ops": 0.0}
    for ev in prof.events():
        if ev.cpu_parent is not None:
            continue
        key = "gemm" if ev.name in GEMM_OPS else "attention" if ev.name == "kiln::paged_attention" else "other ops"
        out[key] += ev.cpu_time_total / 1e3 / steps
    return out


def streamed_bytes(engine) -> int:
    """Weights bytes read by one decode step: the builder's memory plan (every weight except the rows gathered
    from the embedding and rope tables, at the bytes the engine stores them in: a quantized engine's embedding is
    not fp32, which the estimate this replaced assumed, so int4's bound came out 12 MB and its share 5%)."""
    return engine.config.memory.decode_read_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="fp32,bf16,int8,int4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", default="300m", choices=["300m", "246m"],
                    help="checkpoint: 300m (311M parameters, 22 layers) or 246m (16 layers: the size the "
                         "peers' numbers in ../shared/notes were measured on)")
    ap.add_argument("--skip-hf", action="store_true",
                    help="skip the transformers batch-1 decode baseline (fp32 and bf16, same checkpoint)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse engines this script built before (when the builder's passes have not changed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kiln.runtime import Engine

    ckpt = ensure_checkpoint(args.size)
    variants = args.variants.split(",")
    cpuinfo = open("/proc/cpuinfo").read().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo if ln.startswith("flags")), [])
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    log(f"cpu: {cpu} ({', '.join(simd)}), torch {torch.__version__}, {torch.get_num_threads()} threads")

    builds: dict[str, dict] = {}
    for v in variants:
        out = engine_dir(v, args.size)
        if not (args.reuse and engine_is_current(out, build_config(v).to_dict())):
            out = build(v, ckpt, args.size)
        builds[v] = json.loads((out / "build_report.json").read_text())

    log("measuring memory bandwidth ...")
    bw = measure_bandwidth()
    log("bandwidth: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items()))

    # The cores and the memory bus are shared with other machines' work, and the read rate moves
    # (24-30 GB/s in one hour here): each step is followed by a 256 MiB streaming read, and a step is
    # compared with the reads made between the same steps.
    read_buf = torch.ones(1 << 26)
    rows = []
    for v in variants:
        engine = Engine.from_dir(engine_dir(v, args.size))
        streamed = streamed_bytes(engine)
        for batch in (1, 16):
            inputs = decode_inputs(engine, batch)
            times, rates, steal = _interleaved(lambda: engine.run(inputs), lambda: stream_read_rate(read_buf),
                                               args.steps)
            parts = breakdown(engine, inputs)
            rows.append((v, batch, engine.weights_bytes, streamed, times, rates, steal, parts))
        engine = None  # free it before the next one loads
    read_buf = None
    peak_bw = max([*bw.values(), *(r for row in rows for r in row[5])])
    hf: dict[str, float] = {}
    if not args.skip_hf:
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            log(f"transformers {name} batch-1 decode (baseline) ...")
            hf[name] = hf_decode_tok_s(ckpt, dtype)

    print()
    print("build time per stage (s)")
    stages = ["load", "trace", "passes", "export", "memory_plan", "compile", "write", "total"]
    print(f"{'engine':<14} " + " ".join(f"{s:>11}" for s in stages))
    for v in variants:
        t = builds[v]["timings_s"]
        print(f"{v:<14} " + " ".join(f"{t.get(s, 0):>11.2f}" for s in stages))
    print()
    print(f"decode step, context {CONTEXT}, {torch.get_num_threads()} threads; bound = streamed weights / read rate")
    print("step ms: median of the steps (what a user sees on this shared machine); best: the fastest step. read GB/s:")
    print("median of the streaming reads made between the same steps; bound ms and % of bound from it. strict: % of")
    print(f"the bound at the best read rate of the whole run ({peak_bw:.1f} GB/s). tok/s from the median step. steal:")
    print("share of the CPUs' time the hypervisor gave other machines during the steps (/proc/stat).")
    print(f"{'engine':<14} {'batch':>5} {'weights MB':>10} {'streamed MB':>11} {'step ms':>8} {'best ms':>8} "
          f"{'read GB/s':>9} {'bound ms':>8} {'% of bound':>10} {'strict':>6} {'tok/s':>8} {'steal':>6}   "
          "profiled ms/step: gemm | attention | other ops (GEMM GB/s)")
    for v, batch, wb, sb, times, rates, steal, parts in rows:
        ms, best = statistics.median(times) * 1e3, min(times) * 1e3
        read = statistics.median(rates)
        bound = sb / (read * 1e9) * 1e3
        strict = sb / (peak_bw * 1e9) * 1e3
        gemm_bw = sb / (parts["gemm"] / 1e3) / 1e9 if parts["gemm"] else 0.0
        print(f"{v:<14} {batch:>5} {wb / 1e6:>10.1f} {sb / 1e6:>11.1f} {ms:>8.2f} {best:>8.2f} {read:>9.1f} "
              f"{bound:>8.2f} {100 * bound / ms:>9.0f}% {100 * strict / ms:>5.0f}% {batch * 1000 / ms:>8.1f} "
              f"{100 * steal:>5.1f}%   "
              f"{parts['gemm']:.1f} | {parts['attention']:.1f} | {parts['other ops']:.1f} ({gemm_bw:.1f})")
    if hf:
        print()
        print("batch-1 decode, same checkpoint and context, transformers generate (greedy): "
              + ", ".join(f"{k} {v:.1f} tok/s" for k, v in hf.items()))
        for v, batch, _wb, _sb, times, *_ in rows:
            dtype = VARIANTS[v]["dtype"]
            if batch == 1 and dtype in hf:
                tok_s = 1 / statistics.median(times)
                print(f"  kiln {v:<14} {tok_s:6.1f} tok/s = x{tok_s / hf[dtype]:.2f} transformers {dtype}")


if __name__ == "__main__":
    sys.exit(main())
