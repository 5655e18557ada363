"""8-bit KV cache benchmark (not a test): decode steps over bf16, int8 and fp8 pools, and what kiln plan serves.

    .venv/bin/python scripts/bench_kv_quant.py --build-only          # engines, untimed (run it via cpu-shared)
    .venv/bin/python scripts/bench_kv_quant.py [--rounds 2] [--steps 5] [--threads 2]   # timed (cpu-exclusive)

A random 246M Llama (16 layers, hidden 1024, 4 KV heads of 64; ``work/bench/llama-246m-8k``, 8320 positions)
is built three times with bf16 weights, kv_cache_dtype bfloat16 / int8 / fp8 (``cpu`` backend, batch up to
256, sequences up to 8320 tokens). The pool's context is written directly (random keys/values through the pool's
own format, kiln.plugins.kv_quant): prefilling 16 x 8192 tokens on 2 cores would take most of an hour and
measures nothing of the KV cache's format. Then, per KV dtype, in alternating rounds:

- a whole decode step (``Engine.run``: the GEMMs of 16 layers + attention) at context 2048 and 8192 with 1 and
  16 sequences (median of ``--steps``);
- the attention op alone (``kiln::paged_attention`` of one layer, the same shapes), which is what the pool's
  format changes.

Last, ``kiln plan --engine ... --device cpu:24 --trace azure_llm_2023_code.csv`` per engine: the KV pool and the
concurrency the planner gives for the Azure code trace (lengths as recorded, clipped to the engine).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_common import BENCH, engine_is_current, log

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent.parent / "shared" / "traces" / "azure_llm_2023_code.csv"
CKPT = BENCH / "llama-246m-8k"
MAX_POS = 8320
KV = ("bfloat16", "int8", "fp8")
CONTEXTS = (2048, 8192)
BATCHES = (1, 16)
# batch 256: what kiln plan may give the trace (the steps timed here run at most 16 sequences)
BUILD = dict(dtype="bfloat16", backend="cpu", max_batch_size=256, max_input_len=8192, max_seq_len=MAX_POS,
             max_num_tokens=512, tokens_per_block=16)
POOL_SEQS = max(BATCHES)


def ensure_checkpoint() -> Path:
    if not (CKPT / "config.json").exists():
        from synthetic_checkpoints import make_checkpoint

        log(f"creating a random 246m Llama with {MAX_POS} positions in {CKPT} (once) ...")
        make_checkpoint(CKPT, "llama", "246m", max_position_embeddings=MAX_POS)
    return CKPT


def engine_dir(kv: str) -> Path:
    return BENCH / f"engine-kvquant-246m-{kv}"


def ensure_engines() -> dict[str, Path]:
    from kiln.builder import BuildConfig, build_engine

    ckpt = ensure_checkpoint()
    out = {}
    for kv in KV:
        build = {**BUILD, "kv_cache_dtype": kv}
        path = engine_dir(kv)
        if not engine_is_current(path, build):
            log(f"building {path.name} ...")
            build_engine(ckpt, path, BuildConfig(**build), progress=lambda s, m: log(f"  {s}: {m}"))
        out[kv] = path
    return out


def fill_pool(pool: torch.Tensor, kv_dtype: torch.dtype, seed: int = 0) -> None:
    """Every slot: random keys/values (N(0, 1)) stored as the pool stores them (64 distinct blocks, tiled)."""
    from kiln.plugins.kv_quant import to_pool, writable

    g = torch.Generator().manual_seed(seed)
    layers, _, nb, bs, hkv, _ = pool.shape
    head_dim = pool.shape[-1] - (2 if kv_dtype in (torch.int8, torch.float8_e4m3fn) else 0)
    tiles = min(64, nb)
    idx = torch.arange(nb) % tiles
    for layer in range(layers):
        for which in range(2):
            rows = to_pool(torch.randn(tiles, bs, hkv, head_dim, generator=g).to(torch.bfloat16), kv_dtype)
            writable(pool[layer, which]).copy_(writable(rows)[idx])


def decode_inputs(engine, pool: torch.Tensor, batch: int, context: int) -> dict[str, torch.Tensor]:
    from kiln.contract import SeqChunk, pack_inputs

    bs = engine.config.bounds.tokens_per_block
    per_seq = -(-(context + 1) // bs)
    stride = pool.shape[2] // POOL_SEQS
    chunks = [SeqChunk([7 + i], context, range(i * stride, i * stride + per_seq)) for i in range(batch)]
    return pack_inputs(chunks, pool, bs)


def median_s(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(engine, kv: str, steps: int) -> dict[str, dict[str, float]]:
    """Step and one-layer attention times (ms) at every (batch, context)."""
    m = engine.config.rank_model
    bs = engine.config.bounds.tokens_per_block
    per_seq = -(-(max(CONTEXTS) + 1) // bs)
    pool = engine.allocate_kv_cache(POOL_SEQS * per_seq)
    fill_pool(pool, engine.kv_dtype)
    out: dict[str, dict[str, float]] = {}
    g = torch.Generator().manual_seed(1)
    for batch in BATCHES:
        for context in CONTEXTS:
            inputs = decode_inputs(engine, pool, batch, context)
            step = median_s(lambda: engine.run(inputs), steps)
            q = torch.randn(batch, m.num_heads, m.head_dim, generator=g).to(torch.bfloat16)
            k = torch.randn(batch, m.num_kv_heads, m.head_dim, generator=g).to(torch.bfloat16)
            args = (q, k, k.clone(), pool, 0, inputs["seq_lens"], inputs["context_lens"], inputs["block_tables"],
                    inputs["slot_mapping"], m.head_dim ** -0.5, 0)
            attn = median_s(lambda: torch.ops.kiln.paged_attention(*args), 4 * steps)
            out[f"b{batch}_c{context}"] = {"step_ms": round(1e3 * step, 2), "attention_layer_ms": round(1e3 * attn, 3)}
            log(f"  {kv:<9} batch {batch:>2} context {context}: step {1e3 * step:8.2f} ms, attention (1 layer) "
                f"{1e3 * attn:7.3f} ms")
    return out


def kiln_plan(engine: Path, out: Path) -> dict:
    args = ["plan", "--engine", str(engine), "--device", "cpu:24", "--trace", str(TRACE), "--clip-to-engine",
            "--kv-cache-memory-fraction", "0.9", "--output", str(out)]
    log("$ kiln " + " ".join(shlex.quote(a) for a in args))
    subprocess.run([str(Path(sys.executable).parent / "kiln"), *args], check=True, stdout=subprocess.DEVNULL)
    p = json.loads(out.read_text())["plan"]
    pick = {"kv_bytes_per_token": p["memory"]["kv_bytes_per_token_per_device"]["value"],
            "kv_pool_tokens": p["memory"]["kv_pool_tokens"]["value"]}
    pick.update({k: v["value"] for k, v in p["concurrency"].items() if isinstance(v.get("value"), (int, float))})
    return pick


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--plan-only", action="store_true", help="only the kiln plan part (untimed)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=BENCH / "kv_quant")
    args = ap.parse_args()
    engines = ensure_engines()
    if args.build_only:
        return 0
    from kiln.runtime import Engine

    torch.set_num_threads(args.threads)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    log(f"cpu: {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    rounds: dict[str, list[dict]] = {kv: [] for kv in KV}
    for r in range(0 if args.plan_only else args.rounds):
        for kv in (KV if r % 2 == 0 else tuple(reversed(KV))):
            log(f"round {r + 1}: {kv}")
            engine = Engine.from_dir(engines[kv])
            rounds[kv].append(measure(engine, kv, args.steps))
            del engine
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"cpu": cpu, "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "timings": {}, "plan": {}}
    if not args.plan_only:
        print(f"\ndecode, 246m Llama bf16 weights, {args.threads} threads, median of {args.steps} steps, best of "
              f"{args.rounds} rounds (ms); x = vs bfloat16")
        print(f"{'case':<12} " + " ".join(f"{kv + ' step':>16} {'attn/layer':>10}" for kv in KV))
    for case in rounds[KV[0]][0] if rounds[KV[0]] else ():
        row = {}
        for kv in KV:
            row[kv] = {k: min(r[case][k] for r in rounds[kv]) for k in ("step_ms", "attention_layer_ms")}
        results["timings"][case] = row
        base = row[KV[0]]
        cells = []
        for kv in KV:
            x = base["step_ms"] / row[kv]["step_ms"]
            cells.append(f"{row[kv]['step_ms']:>9.1f} x{x:4.2f} {row[kv]['attention_layer_ms']:>10.2f}")
        print(f"{case:<12} " + " ".join(cells))
    for kv in KV:
        results["plan"][kv] = kiln_plan(engines[kv], args.out / f"plan-{kv}.json")
    print("\nkiln plan, Azure code trace (clipped to 8320 tokens), device cpu:24, kv fraction 0.9")
    for kv in KV:
        p = results["plan"][kv]
        print(f"  {kv:<9} {p['kv_bytes_per_token']:>6} B/token, pool {p['kv_pool_tokens']:>9,} tokens, "
              f"max concurrent sequences {p.get('max_concurrent_sequences')}, KV sequences at p95 "
              f"{p.get('kv_sequences_at_p95', '?')}")
    path = args.out / ("plan.json" if args.plan_only else "result.json")
    path.write_text(json.dumps(results, indent=2) + "\n")
    log(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
