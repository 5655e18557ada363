"""Kernel tunables against each other in whole single-stream requests, in one process (not a test).

    .venv/bin/python scripts/bench_tunables.py ENGINE_DIR "label:name=value,...;label:name=value,..." [--rounds 16]

Each variant sets kernel tunables (``kiln.plugins.tuning``: prefetch distances, panels per decode stream,
``row_nta``) on top of the machine's tuning; the first is the reference. Every round runs one request per variant
(order reversed every other round) in the same ``LLM``: a 32-token prompt (``--prompt``: longer contexts, for
``attn_span_context``), 64 new tokens, greedy, EOS ignored, as ``../shared/peers/bench_kiln.py single``; decode
tok/s as ``bench_decode.py`` counts it (``single_request``). ``--batch N``: N such requests at once (random prompts
of their own), the decode steps of a batch as a serving engine runs them; tok/s = N x (tokens - 1) / (time of the
whole batch - time of its prefill + first token).

Why in one process: separate processes (``bench_decode.py --variants``) also differ in where their weights and
pool landed in memory, and this VM's read rate drifts by 15-25% from minute to minute; alternating variants in one
process request by request puts both on every variant alike, so the paired ratios of a few rounds are stable where
process-per-run medians are not. A tunable whose effect is on the rest of the step (``row_nta``: what a weight
stream evicts) shows only here, never in a kernel timed alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable


def parse_variants(text: str) -> dict[str, dict[str, int]]:
    variants: dict[str, dict[str, int]] = {}
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        label, _, values = spec.partition(":")
        settings = {}
        for item in filter(None, (v.strip() for v in values.split(","))):
            name, _, value = item.partition("=")
            settings[name.strip()] = int(value)
        variants[label.strip()] = settings
    if not variants:
        raise SystemExit("give at least one variant, e.g. 'nta:row_nta=1;t0:row_nta=0'")
    return variants


def compare_variants(lib, variants: dict[str, dict[str, int]], rounds: int, measure: Callable[[], float],
                     on_round: Callable[[int, dict[str, list[float]]], None] | None = None) -> dict[str, list[float]]:
    """measure() (higher is better) of every variant in every round, the variants' tunables set on top of the
    machine's tuning in turn (the order reversed every other round) and the machine's tuning put back after;
    ``on_round(round, values so far)`` after each round."""
    from kiln.plugins import tuning

    base = tuning.current(lib)
    values: dict[str, list[float]] = {label: [] for label in variants}
    try:
        for r in range(rounds):
            for label in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                for name, value in {**base, **variants[label]}.items():
                    tuning.set_value(lib, name, value)
                values[label].append(measure())
            if on_round:
                on_round(r, values)
    finally:
        for name, value in base.items():
            tuning.set_value(lib, name, value)
    return values


def print_paired(values: dict[str, list[float]], unit: str) -> None:
    """Per variant the median over the rounds and the paired ratio to the first variant in the same round."""
    ref = next(iter(values))
    print(f"\nmedians over {len(values[ref])} rounds; paired = variant / {ref} in the same round")
    for label, vs in values.items():
        ratios = [a / b for a, b in zip(vs, values[ref])]
        print(f"{label:12s} {statistics.median(vs):8.1f} {unit}   paired x{statistics.median(ratios):.3f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}), faster in {sum(x > 1 for x in ratios)}/{len(ratios)} rounds")


def batch_request(llm, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(seconds of the batch's prefill + 1 token, seconds of the whole batch of ``tokens`` tokens each), greedy."""
    from kiln.runtime import SamplingParams

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        dt = time.perf_counter() - t0
        assert all(len(o.token_ids) == n for o in outs), [(len(o.token_ids), o.finish_reason) for o in outs]
        return dt
    return gen(1), gen(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine")
    ap.add_argument("variants", help="semicolon-separated label:name=value,... (the first is the reference)")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (random ids)")
    ap.add_argument("--batch", type=int, default=1, help="requests at once (each its own random prompt)")
    args = ap.parse_args()

    from bench_decode import single_request

    from kiln.plugins import native, tuning
    from kiln.runtime import LLM

    variants = parse_variants(args.variants)
    lib = native.library()
    if lib is None:
        raise SystemExit("the native kernel library is not available here: no tunables to compare")
    base = tuning.current(lib)
    llm = LLM(args.engine, max_batch_size=max(16, args.batch),
              max_kv_cache_tokens=max(256, args.batch * (args.prompt + args.tokens + 16)), enable_prefix_reuse=False)
    vocab = llm.executor.engine.config.model.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.batch)]

    def run(tokens: int) -> tuple[float, float]:
        return single_request(llm, prompts[0], tokens) if args.batch == 1 else batch_request(llm, prompts, tokens)

    run(8)   # warm-up
    info = native.cpu_info()
    print(f"cpu family {info.get('cpu family', '?')} model {info.get('model', '?')}; machine tuning {base}", flush=True)
    def measure() -> float:
        first, total = run(args.tokens)
        return args.batch * (args.tokens - 1) / (total - first)

    def report(r: int, tok_s: dict[str, list[float]]) -> None:
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:.1f}" for k, v in tok_s.items()), flush=True)

    try:
        tok_s = compare_variants(lib, variants, args.rounds, measure, report)
    finally:
        llm.executor.close()
    print_paired(tok_s, "tok/s")


if __name__ == "__main__":
    main()
