"""Structured output's cost (not a test): masked decode steps, grammar compile times, and the step loop
while a large grammar compiles.

    .venv/bin/python scripts/bench_structured.py --prepare            # checkpoint + engine (untimed)
    /work/tools/cpu-exclusive .venv/bin/python scripts/bench_structured.py [--rounds 3]

The 246M random Llama with a 32k byte-level BPE vocabulary (``work/bench/llama-246m``) in an int8
weight-only ``cpu`` engine (the fastest decode here, so the mask is the largest share of a step):

1. decode step time at batch 1 and 16, every row constrained by a JSON schema (objects with integers,
   bounded strings and booleans: the mask is filled in every state of the grammar) vs no row constrained,
   A/B alternating ``--rounds`` times; only steps where every sequence decodes are counted (median). The
   mask time per step comes from the runtime's ``grammar_mask_time`` histogram.
2. compile time of a small and a large schema against the 32k vocabulary (each new to the cache), and a
   cache hit.
3. the step loop while a large schema compiles: 8 unconstrained streams decode; a request with a large
   (uncached) schema arrives; the streams' inter-token latency while it compiles vs before it, with the
   compile thread at each of ``--priorities`` (SCHED_IDLE, the default, and normal priority).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

from bench_common import ensure_checkpoint, ensure_engine, log

BUILD = dict(dtype="float32", quantization="int8_weight_only", backend="cpu", max_batch_size=16, max_input_len=256,
             max_seq_len=512, max_num_tokens=256, tokens_per_block=16)
PROMPT_LEN, DECODE = 32, 48
WINDOW_S = 4.0   # decoding before and after a compile that TPOT during it is compared with

ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                          "name": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"}},
        "required": ["id", "name", "ok"], "additionalProperties": False}
LONG = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 32, "maxItems": 32}},
        "required": ["items"], "additionalProperties": False}   # never complete within DECODE tokens
SMALL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 150}},
         "required": ["name", "age"], "additionalProperties": False}


def large_schema(tag: str, fields: int = 40) -> dict:
    """A schema of ``fields`` properties, each an anyOf of a patterned string, a bounded integer, a
    bounded array of numbers and a small object; ``tag`` makes it new to the cache."""
    one = {"anyOf": [{"type": "string", "pattern": "[a-z]{2,8}"},
                     {"type": "integer", "minimum": -1000, "maximum": 1000},
                     {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 5},
                     {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"enum": ["a", "b", "c"]}}}]}
    return {"type": "object", "properties": {f"{tag}_{i}": one for i in range(fields)},
            "required": [f"{tag}_{i}" for i in range(0, fields, 3)], "additionalProperties": False}


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(n)]


def decode_steps(llm, prompts, params) -> tuple[list[float], list[float]]:
    """Step times and engine times of the steps in which every request decodes."""
    executor = llm.executor
    executor.metrics.steps.clear()
    llm.generate(prompts, params)
    steps = [s for s in executor.metrics.steps if s.prefill_tokens == 0 and s.batch_size == len(prompts)]
    return [s.step_time for s in steps], [s.engine_time for s in steps]


def bench_steps(llm, rounds: int) -> list[dict]:
    from kiln.runtime import SamplingParams

    rows = []
    for batch in (1, 16):
        prompts = random_prompts(batch, PROMPT_LEN, seed=batch)
        plain = [SamplingParams(max_tokens=DECODE, temperature=1.0, seed=i, ignore_eos=True) for i in range(batch)]
        constrained = [SamplingParams(max_tokens=DECODE, temperature=1.0, seed=i, structured_output={"json": LONG})
                       for i in range(batch)]
        llm.generate(prompts, constrained)   # compile once, and warm up
        times: dict[str, list[float]] = {"none": [], "all": []}
        engine: dict[str, list[float]] = {"none": [], "all": []}
        masks: list[float] = []
        for _ in range(rounds):
            for name, params in (("none", plain), ("all", constrained)):
                before = llm.stats()["histograms"]["grammar_mask_time"]
                step, eng = decode_steps(llm, prompts, params)
                after = llm.stats()["histograms"]["grammar_mask_time"]
                times[name] += step
                engine[name] += eng
                if name == "all" and after["count"] > before["count"]:
                    masks.append((after["sum"] - before["sum"]) / (after["count"] - before["count"]))
        none, every = statistics.median(times["none"]), statistics.median(times["all"])
        row = dict(batch=batch, steps=len(times["all"]), step_ms_none=none * 1e3, step_ms_all=every * 1e3,
                   ratio=every / none, engine_ms_none=statistics.median(engine["none"]) * 1e3,
                   engine_ms_all=statistics.median(engine["all"]) * 1e3, mask_ms=statistics.mean(masks) * 1e3)
        log(f"batch {batch}: decode step {row['step_ms_none']:.1f} ms unconstrained, {row['step_ms_all']:.1f} ms "
            f"all rows constrained (x{row['ratio']:.3f}); engine {row['engine_ms_none']:.1f} / "
            f"{row['engine_ms_all']:.1f} ms; mask {row['mask_ms']:.2f} ms per step; {row['steps']} steps each")
        rows.append(row)
    return rows


def bench_compile(llm) -> dict:
    from kiln.runtime.structured_output import StructuredOutputParams

    compiler = llm.executor.grammar_compiler()
    out = {}
    for name, schema in (("small", SMALL), ("large", large_schema("compile"))):
        spec = StructuredOutputParams(json=schema)
        t0 = time.perf_counter()
        future = compiler.prepare(spec)
        parsed = time.perf_counter() - t0
        future.result()
        total = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.prepare(spec).result()
        hit = time.perf_counter() - t0
        out[name] = dict(parse_ms=parsed * 1e3, compile_s=total, cache_hit_ms=hit * 1e3,
                         schema_chars=len(json.dumps(schema)))
        log(f"{name} schema ({out[name]['schema_chars']} chars): parsed in {parsed * 1e3:.1f} ms (caller's thread), "
            f"compiled in {total:.2f} s (pool), cache hit {hit * 1e3:.3f} ms")
    return out


def bench_tpot_during_compile(llm, priority, tag: str) -> dict:
    """Inter-token gaps of 8 decoding streams before and while a large uncached schema compiles, its
    compile thread at ``priority`` (kiln.runtime.grammar.COMPILE_PRIORITY)."""
    from concurrent.futures import ThreadPoolExecutor

    import kiln.runtime.grammar as grammar
    from kiln.runtime import SamplingParams

    grammar.COMPILE_PRIORITY = priority
    compiler = llm.executor.grammar_compiler()
    compiler._pool.shutdown(wait=True)   # fresh threads, started at this priority
    compiler._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-grammar",
                                        initializer=grammar._lower_priority)
    times: list[list[float]] = [[] for _ in range(8)]
    done = threading.Event()
    left = [8]

    def on_output(i):
        def cb(out):
            times[i].extend([time.perf_counter()] * len(out.delta_token_ids))
            if out.finished:
                left[0] -= 1
                if not left[0]:
                    done.set()
        return cb

    prompts = random_prompts(8, PROMPT_LEN, seed=7)
    for i, p in enumerate(prompts):
        llm.submit(p, SamplingParams(max_tokens=480, temperature=1.0, seed=i, ignore_eos=True), callback=on_output(i))
    while min(len(t) for t in times) < 10:
        time.sleep(0.01)
    time.sleep(WINDOW_S)
    start = time.perf_counter()
    schema = large_schema(tag, fields=60)
    llm.submit([5] * PROMPT_LEN, SamplingParams(max_tokens=8, structured_output={"json": schema}))
    future = compiler.prepare(grammar.StructuredOutputParams(json=schema))
    future.result()
    end = time.perf_counter()
    done.wait()
    llm.executor.wait_idle(60)

    def gaps(lo: float, hi: float) -> list[float]:
        return [b - a for t in times for a, b in zip(t, t[1:]) if lo <= a and b <= hi]

    compile_s = end - start
    before, during, after = gaps(start - WINDOW_S, start), gaps(start, end), gaps(end, end + WINDOW_S)
    row = dict(priority=str(priority), compile_s=compile_s, tpot_ms_before=statistics.median(before) * 1e3,
               tpot_ms_during=statistics.median(during) * 1e3, tpot_ms_after=statistics.median(after) * 1e3,
               gaps=[len(before), len(during), len(after)])
    row["ratio"] = row["tpot_ms_during"] / ((row["tpot_ms_before"] + row["tpot_ms_after"]) / 2)
    log(f"compile thread priority {priority}: a 60-field schema compiled in {compile_s:.2f} s while 8 streams decoded; "
        f"their TPOT (median gap) {row['tpot_ms_before']:.1f} ms before, {row['tpot_ms_during']:.1f} ms during, "
        f"{row['tpot_ms_after']:.1f} ms after (during / mean of the others: x{row['ratio']:.3f}; gaps {row['gaps']})")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true", help="create the checkpoint and build the engine, then exit")
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds of the step-time comparison")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--priorities", default="idle,0", help="compile thread priorities to compare: idle (SCHED_IDLE, "
                                                          "the default), nice increments, or none (normal)")
    ap.add_argument("--only-compile", action="store_true", help="skip the step-time comparison")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    ckpt = ensure_checkpoint("246m")
    engine_dir = ensure_engine("engine-structured-246m-int8", BUILD, ckpt)
    if args.prepare:
        return 0
    import torch

    from kiln.runtime import LLM

    torch.set_num_threads(args.threads)
    priorities = [p if p == "idle" else None if p == "none" else int(p) for p in args.priorities.split(",")]
    with LLM(engine_dir) as llm:
        results = {"steps": [] if args.only_compile else bench_steps(llm, args.rounds), "compile": bench_compile(llm),
                   "tpot_during_compile": [bench_tpot_during_compile(llm, p, f"t{i}")
                                           for i, p in enumerate(priorities)]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
