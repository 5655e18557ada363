"""Main job on a small bundled default: make a checkpoint, build an engine, load it, run a packed step.

1. a small Llama checkpoint (``work/demo-llama-corpus``) is created if missing: random weights fitted
   for a few seconds to kiln's synthetic corpus, so that greedy outputs continue the prompts (taken
   from that text) with readable text and the engine's correctness is visible at a glance;
2. ``build_engine`` turns it into an engine directory (``work/demo-llama-corpus-engine``), printing
   each stage and the summary that ``build-engine`` prints;
3. ``kiln.runtime.LLM`` loads the directory (no model code) and generates for a handful of prompts
   concurrently (in-flight batching over a paged KV cache), printing the outputs, each request's
   queue time / TTFT / TPOT and the runtime's metrics summary.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kiln.builder import BuildConfig, build_engine
from kiln.contract import format_table, read_build_report, read_engine_config, summary_rows
from kiln.runtime import LLM, SamplingParams

from synthetic_checkpoints import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
DEMO_TRAIN_STEPS = 150


def main() -> None:
    ckpt = ROOT / "work" / "demo-llama-corpus"
    engine_dir = ROOT / "work" / "demo-llama-corpus-engine"
    if not (ckpt / "config.json").exists():
        print(f"creating a small Llama checkpoint in {ckpt} (random weights fitted to the synthetic corpus, "
              f"{DEMO_TRAIN_STEPS} steps) ...", flush=True)
        t0 = time.perf_counter()
        make_checkpoint(ckpt, "llama", "small", train_steps=DEMO_TRAIN_STEPS)
        print(f"  done in {time.perf_counter() - t0:.1f} s")

    build = BuildConfig.from_yaml(ROOT / "build_configs" / "tiny-test.yaml").replace(tokens_per_block=16)
    print(f"building {ckpt.name} -> {engine_dir.name} ({build.backend}, {build.dtype})")
    build_engine(ckpt, engine_dir, build,
                 progress=lambda stage, msg: print(f"  {stage:<12} {msg}", flush=True))
    print(format_table(summary_rows(read_engine_config(engine_dir), read_build_report(engine_dir))))

    # generation: a handful of prompts submitted together, served with in-flight batching
    # (max_batch_size 4 < 6 prompts, so some wait for a seat and join as others finish)
    llm = LLM(engine_dir, max_kv_cache_tokens=1024)
    prompts = ["The kiln fires the clay", "Tokens flow through", "Memory is the wall:",
               "A request arrives, then another;", "Héllo wörld", "def add(a, b):"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 6, 16, 8, 10, 20)]
    params[1] = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=6)   # one sampled, seeded
    print(f"generating for {len(prompts)} prompts concurrently ({llm.executor.kv_plan})")
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    for out in outs:
        m = out.metrics
        tpot = f"{m.mean_tpot * 1e3:5.1f} ms" if m.mean_tpot is not None else "   -    "
        print(f"{out.prompt!r:36} -> {out.text!r}")
        print(f"{'':36}    {len(out.token_ids):2d} tokens ({out.finish_reason}), queue {m.queue_time * 1e3:5.1f} ms, "
              f"TTFT {m.ttft * 1e3:5.1f} ms, TPOT {tpot}")
    print(f"{sum(len(o.token_ids) for o in outs)} tokens in {wall:.2f} s")
    print("metrics:")
    print("  " + llm.metrics_summary().replace("\n", "\n  "))
    llm.shutdown()

if __name__ == "__main__":
    sys.exit(main())
