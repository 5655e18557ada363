"""Decode attention alone against the read rate, by context length and KV pool dtype (not a test).

    .venv/bin/python scripts/bench_decode_attention.py [--contexts 64,256,1024,1900] [--rounds 7] [--rows 16]

A decode step reads every cached key and value of its sequence once, so at long contexts attention, not the
weights, sets the step time: for the 246M Llama (16 layers, 16 query heads over 4 KV heads of 64) at 1900
positions the fp32 pool is 62 MB a step, half again the int4 weights. This times ``kiln::paged_attention`` for one
decode row (``--rows``: that many, as a batched decode step or a serving step has) over all layers' pools (the
layer loop of a step) two ways, alternating:

- from memory: right after a read-only stream of 64 MiB (as a step's weight stream evicts the context; a written
  buffer would add its write-backs to the reads), the case a decode step is in;
- in cache: one layer's pool read again and again (what the kernel's arithmetic alone costs).

and prints the median ms per step, the KV bytes read per step, the GB/s that implies and that as a share of the
2-thread streaming read rate measured around each run. ``--spans 0,256`` also alternates values of the
``attn_span_context`` tunable within each round (0: one KV head per work item; N: this one row, from N
positions, read every KV head of a position at once and split across the threads), for a paired ratio per case.
Cases: fp32 (fp32 q and pool: fp32 engines, int8/int4 weight-only engines), bf16 (bf16 q and pool: bf16 engines),
fp32+bf16 (fp32 q over a bf16 pool: ``--kv-cache-dtype bfloat16`` on an fp32 engine), int8 (fp32 q over an 8-bit
pool).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_common import log, stream_read_rate

CASES = {  # name -> (q dtype, pool dtype)
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp32+bf16": (torch.float32, torch.bfloat16),
    "int8": (torch.float32, torch.int8),
}


def make_case(case: str, ctx: int, layers: int, hq: int, hkv: int, d: int, rows: int = 1, block: int = 16) -> tuple:
    """(one call's arguments but the layer, the pool's bytes per step) for ``rows`` decode rows (sequences of their
    own, their blocks one after another in the pool) at ``ctx`` positions each."""
    from kiln.contract import SeqChunk, pack_inputs
    from kiln.plugins.kv_quant import to_pool

    qd, pd = CASES[case]
    blocks = ctx // block + 2
    kv = to_pool((torch.randn(layers, 2, rows * blocks, block, hkv, d) * 0.5).to(
        torch.bfloat16 if pd != torch.float32 else torch.float32), pd)
    q, k, v = (torch.randn(rows, h, d).to(qd) for h in (hq, hkv, hkv))
    chunks = [SeqChunk([7], ctx - 1, range(r * blocks, (r + 1) * blocks)) for r in range(rows)]
    inputs = pack_inputs(chunks, kv, block)
    args = (q, k, v, kv, *(inputs[n] for n in ("seq_lens", "context_lens", "block_tables", "slot_mapping")))
    return args, layers * 2 * rows * ctx * hkv * kv.shape[-1] * kv.element_size()


def step_ms(args: tuple, layers: int, scale: float, from_memory: bool, evict: torch.Tensor) -> float:
    """ms of one decode step's attention calls (every layer; in cache: layer 0 each time)."""
    q, k, v, kv, seq_lens, ctx, tables, slots = args
    if from_memory:
        stream_read_rate(evict)
    t0 = time.perf_counter()
    for layer in range(layers):
        torch.ops.kiln.paged_attention(q, k, v, kv, layer if from_memory else 0, seq_lens, ctx, tables, slots,
                                       scale, 0, 0.0)
    return 1e3 * (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="64,256,1024,1900")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7, help="timed steps per case and way (medians)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1, help="decode rows a step (sequences of --contexts positions each)")
    ap.add_argument("--spans", default="", help="attn_span_context values to alternate (default: the library's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import kiln.plugins  # noqa: F401  (registers kiln::paged_attention and loads the native kernels)
    from kiln.plugins import native, tuning

    lib = native.library()
    spans = [int(v) for v in args.spans.split(",") if v] or [tuning.get(lib, "attn_span_context")]

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    log(f"cpu: {cpu}, {args.threads} threads, torch {torch.__version__}; {args.layers} layers, {args.heads} heads "
        f"over {args.kv_heads} KV heads of {args.head_dim}, batch {args.rows}")
    evict = torch.ones(16 << 20, dtype=torch.float32)   # 64 MiB, read before each from-memory step
    scale = args.head_dim ** -0.5
    print(f"{'ctx':>6} {'case':10} {'span':>5} {'KV MB':>7} {'memory ms':>10} {'GB/s':>6} {'% read':>7} "
          f"{'cache ms':>9} {'read GB/s':>9} {'x first span':>12}")
    for ctx in (int(c) for c in args.contexts.split(",")):
        for case in args.cases.split(","):
            call, nbytes = make_case(case, ctx, args.layers, args.heads, args.kv_heads, args.head_dim, args.rows)
            mem: dict[int, list[float]] = {v: [] for v in spans}
            cache: dict[int, list[float]] = {v: [] for v in spans}
            rates = []
            for r in range(args.rounds + 1):   # round 0: warm-up (first touch, the kernels' buffers)
                for v in (spans if r % 2 else spans[::-1]):   # the order alternates: no seat is favoured
                    tuning.set_value(lib, "attn_span_context", v)
                    m, c = step_ms(call, args.layers, scale, True, evict), step_ms(call, args.layers, scale, False,
                                                                                  evict)
                    if r:
                        mem[v].append(m)
                        cache[v].append(c)
                rates.append(stream_read_rate(evict))
            r = statistics.median(rates[1:])
            first = mem[spans[0]]
            for v in spans:
                m, c = statistics.median(mem[v]), statistics.median(cache[v])
                paired = statistics.median(a / b for a, b in zip(first, mem[v]))
                gbs = nbytes / m / 1e6
                print(f"{ctx:6} {case:10} {v:5} {nbytes / 1e6:7.1f} {m:10.3f} {gbs:6.1f} {100 * gbs / r:6.0f}% "
                      f"{c:9.3f} {r:9.1f} {paired:11.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
