"""Offline ``LLM.generate`` throughput with the serving defaults (decode pace, queue lead) and with both off (not a
test): generate's requests are not paced, so the two should be level.

    .venv/bin/python scripts/bench_offline_pace.py ENGINE_DIR [--rounds 2] [--prompts 160]

Two cases, alternated between the two configurations (one ``LLM`` at a time, each in its own step loop): 16 prompts
of 128 tokens -> 64 (all fit one step) and ``--prompts`` prompts of 16-600 tokens -> 64 (more than a step's
sequences: prompts are admitted beside decodes, where the pace would chunk them).
"""

from __future__ import annotations

import argparse
import random
import time

from kiln.plugins.openmp_teams import on_own_thread
from kiln.runtime import LLM, SamplingParams

CONFIGS = {"defaults": {}, "unpaced, FCFS": {"tpot_target_s": 0, "short_prompt_lead_s": 0}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=160)
    ap.add_argument("--max-kv-cache-tokens", type=int, default=65536)
    args = ap.parse_args()
    rng = random.Random(0)
    cases = {"16 x (128 -> 64)": [[rng.randrange(100, 30000) for _ in range(128)] for _ in range(16)],
             f"{args.prompts} x (16-600 -> 64)": [[rng.randrange(100, 30000) for _ in range(rng.randrange(16, 600))]
                                                 for _ in range(args.prompts)]}
    params = SamplingParams(max_tokens=64, ignore_eos=True)

    def run() -> None:
        for rnd in range(args.rounds):
            for name, knobs in CONFIGS.items():
                with LLM(args.engine, max_kv_cache_tokens=args.max_kv_cache_tokens, **knobs) as llm:
                    llm.generate(cases["16 x (128 -> 64)"][:4], SamplingParams(max_tokens=8, ignore_eos=True))
                    for case, prompts in cases.items():
                        t = time.perf_counter()
                        outs = llm.generate(prompts, params)
                        dt = time.perf_counter() - t
                        tokens = sum(len(o.token_ids) for o in outs) + sum(len(p) for p in prompts)
                        print(f"round {rnd}  {case:22s}  {name:14s}  {dt:7.2f} s  {tokens / dt:6.0f} tok/s", flush=True)

    on_own_thread(run)   # the step loops' OpenMP teams must not meet one on the main thread


if __name__ == "__main__":
    main()
