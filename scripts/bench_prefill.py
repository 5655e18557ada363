"""Batched-prefill time of a bf16 engine with the oneDNN GEMM path on and off (not a test).

    .venv/bin/python scripts/bench_prefill.py [--size 246m] [--batch 16] [--prompt 128] [--rounds 5]

Times ``engine.run`` of one step that prefills ``batch`` prompts of ``prompt`` random tokens each (the step that
returns their first tokens' logits; no scheduler or sampler) on the synthetic Llama of ``--size`` in bf16, with
``linear.bf16_gemm_m()`` at its default (oneDNN bf16 GEMMs on the panels in place from that many rows, on AMX CPUs)
and at 0 (kiln's panel kernels at every M), alternating round by round; prints each setting's best and median.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench_common import ensure_checkpoint, ensure_engine, log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="246m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from kiln.contract import NO_ADAPTER, SeqChunk, pack_inputs
    from kiln.plugins import linear
    from kiln.runtime import Engine

    tokens = args.batch * args.prompt
    ckpt = ensure_checkpoint(args.size)
    engine_dir = ensure_engine(f"llama-{args.size}-bf16-b{args.batch}-t{tokens}", dict(
        dtype="bfloat16", max_batch_size=args.batch, max_num_tokens=tokens), ckpt)
    engine = Engine.from_dir(engine_dir)
    bs = engine.config.bounds.tokens_per_block
    per_seq = -(-args.prompt // bs)
    kv = engine.allocate_kv_cache(args.batch * per_seq)
    rng = random.Random(0)
    vocab = engine.config.model.vocab_size
    chunks = [SeqChunk([rng.randrange(3, vocab) for _ in range(args.prompt)], 0,
                       list(range(s * per_seq, (s + 1) * per_seq)), 1, NO_ADAPTER) for s in range(args.batch)]
    inputs = pack_inputs(chunks, kv, bs)
    default_m = linear.bf16_gemm_m()
    settings = {f"AMX GEMM from M {default_m}": default_m, "panel kernels only": 0}
    times: dict[str, list[float]] = {name: [] for name in settings}
    first: dict[str, torch.Tensor] = {}
    for name, m in settings.items():   # warm-up (and each setting's first-token logits)
        linear.set_bf16_gemm_m(m)
        first[name] = engine.run(inputs).clone()
    for _ in range(args.rounds):
        for name, m in settings.items():
            linear.set_bf16_gemm_m(m)
            t0 = time.perf_counter()
            engine.run(inputs)
            times[name].append(time.perf_counter() - t0)
    linear.set_bf16_gemm_m(default_m)
    log(f"{args.size} bf16, {args.batch} x {args.prompt} prefill (one engine.run), {args.threads} threads, "
        f"{args.rounds} rounds")
    for name, ts in times.items():
        log(f"  {name:<24} best {min(ts) * 1e3:8.1f} ms  median {statistics.median(ts) * 1e3:8.1f} ms  "
            f"({tokens / min(ts):.0f} tokens/s)")
    a, b = (first[n] for n in settings)
    log(f"  first-token logits, max |difference| between the two: {(a - b).abs().max().item():.4g} "
        f"(max |logit| {b.abs().max().item():.3g}); same argmax in {(a.argmax(-1) == b.argmax(-1)).sum()} of "
        f"{a.shape[0]} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
