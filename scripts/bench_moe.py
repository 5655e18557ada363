"""Decode step of an MoE engine against a dense engine of the same active size, at batch 1 (benchmark, not a test).

    /work/tools/cpu-shared .venv/bin/python scripts/bench_moe.py --prepare     # checkpoints + engines, once
    /work/tools/cpu-exclusive .venv/bin/python scripts/bench_moe.py [--quantization none int8_weight_only]
                                                                      [--moe mixtral qwen3_moe] [--rounds 5]

Models (random weights, scripts/synthetic_checkpoints.py): the dense 246m Llama (16 layers, hidden 1024, MLP 2816)
and its MoE twins with the same attention and the same MLP width per token: Mixtral-style (preset 246m-moe8: 8
experts of 1408, top 2) and Qwen3-MoE-style (246m-moe16: 16 experts of 704, top 4, q/k norms), ~660M parameters
each, ~246M active. Each engine (cpu backend, built once into work/bench/moe-*) runs a 64-token prefill, then
decode steps of one sequence through Engine.run; the engines take turns, --steps steps per turn, --rounds
turns, with a streaming read of 64 MiB between turns (the machine's read rate of the moment). Printed per engine:
the median step, the weight bytes a step reads (the builder's memory plan: config.json memory.decode_read_bytes),
those bytes over the step time, and the step time over the dense engine's (the target: MoE <= 1.3x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kiln.contract import SeqChunk, pack_inputs
from kiln.runtime import Engine

import bench_common
from bench_common import BENCH, ensure_engine, log, stream_read_rate

PRESETS = {"llama": "246m", "mixtral": "246m-moe8", "qwen3_moe": "246m-moe16"}
BUILD = dict(max_batch_size=4, max_input_len=256, max_seq_len=512, max_num_tokens=256, tokens_per_block=16)


def ensure_checkpoint(family: str):
    from synthetic_checkpoints import make_checkpoint

    if family == "llama":
        return bench_common.ensure_checkpoint(PRESETS[family])
    path = BENCH / f"{family}-{PRESETS[family]}"
    if not (path / "config.json").exists():
        log(f"creating a random {PRESETS[family]} {family} checkpoint in {path} (once) ...")
        make_checkpoint(path, family, PRESETS[family])
    return path


class Decoder:
    """One sequence on one engine: a 64-token prefill, then one token per step (its context grows by one)."""

    def __init__(self, engine: Engine, prompt: int = 64):
        self.engine = engine
        bs = engine.config.bounds.tokens_per_block
        self.blocks = list(range(engine.config.bounds.max_blocks_per_seq))
        self.kv = engine.allocate_kv_cache(len(self.blocks))
        self.bs, self.pos, self.token = bs, 0, 5
        self.step([3 + i % 100 for i in range(prompt)])

    def step(self, tokens: list[int] | None = None) -> None:
        tokens = tokens or [self.token]
        inputs = pack_inputs([SeqChunk(tokens, self.pos, self.blocks, 1)], self.kv, self.bs)
        self.token = int(self.engine.run(inputs)[0].argmax())
        self.pos += len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", nargs="+", default=["none", "int8_weight_only"])
    ap.add_argument("--moe", nargs="+", default=["mixtral", "qwen3_moe"], choices=["mixtral", "qwen3_moe"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prepare", action="store_true",
                    help="only create the checkpoints and build the engines (heavy but untimed: run it under "
                         "/work/tools/cpu-shared first, then the timed run under cpu-exclusive)")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    results = []
    buf = torch.ones(16 << 20, dtype=torch.float32)
    for quant in args.quantization:
        names = ["llama", *args.moe]
        engines = {}
        for family in names:
            build = {**BUILD, "quantization": quant}
            directory = ensure_engine(f"moe-{family}-{quant}", build, ensure_checkpoint(family))
            if not args.prepare:
                engines[family] = Engine.from_dir(directory)
        if args.prepare:
            continue
        decoders = {f: Decoder(e) for f, e in engines.items()}
        times: dict[str, list[float]] = {f: [] for f in names}
        rates = []
        for _ in range(args.rounds):
            for f in names:
                rates.append(stream_read_rate(buf))
                d = decoders[f]
                d.step()   # warm
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    d.step()
                times[f].append((time.perf_counter() - t0) / args.steps)
        dense = statistics.median(times["llama"])
        for f in names:
            mem = engines[f].config.memory
            step = statistics.median(times[f])
            row = dict(model=f, quantization=quant, step_ms=round(step * 1e3, 2),
                       steps_ms=[round(t * 1e3, 2) for t in times[f]],
                       decode_read_mb=round(mem.decode_read_bytes / 1e6),
                       weights_mb=round(mem.weights_bytes / 1e6), total_params=mem.total_params,
                       active_params=mem.active_params, gb_per_s=round(mem.decode_read_bytes / step / 1e9, 1),
                       vs_dense=round(step / dense, 3))
            results.append(row)
            log(f"{quant:>16} {f:>9}: step {row['step_ms']:6.2f} ms (turns {row['steps_ms']}), reads "
                f"{row['decode_read_mb']} MB of {row['weights_mb']} MB -> {row['gb_per_s']} GB/s, "
                f"{row['vs_dense']:.2f}x dense; params {mem.total_params / 1e6:.0f}M total, "
                f"{mem.active_params / 1e6:.0f}M active")
        log(f"streaming read of 64 MiB between turns: {min(rates):.1f}-{max(rates):.1f} GB/s")
        for e in engines.values():
            e.close()
    if args.prepare:
        return
    out = BENCH / "moe-result.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(),
                               "results": results}, indent=1))
    log(f"results: {out}")


if __name__ == "__main__":
    main()
