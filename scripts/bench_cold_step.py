"""What the step loop's small calls cost right after a decode step's weight stream (not a test).

    .venv/bin/python scripts/bench_cold_step.py [ENGINE_DIR] [--stream-mb 128] [--repeats 60]

A batch-1 decode step streams every weight once (110-850 MB on the 246M Llama), which evicts the interpreter's and
torch's code and data from the caches; the step loop's Python (schedule, pack, sample, emit, record) then runs cold
after every step. This times a few such calls (pure Python, a torch allocation, a tiny in-place torch op, the
kiln argmax of a logits row, ``torch.tensor`` of a short list) three ways, medians of ``--repeats``:

- warm: the call right after the same call;
- after a stream: right after a 2-thread read of ``--stream-mb`` MB (``kiln_stream_sum``), as a step's weights;
- after a decode step: right after ``engine.run`` of one decode token of ENGINE_DIR (context 64), if given.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch


def median_us(fn: Callable[[], object], before: Callable[[], object], repeats: int) -> float:
    """Median microseconds of fn() right after before()."""
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", nargs="?", help="an engine directory: also time the calls right after a decode step")
    ap.add_argument("--stream-mb", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from kiln.plugins import native
    from kiln.plugins.argmax import argmax_rows

    lib = native.library()
    if lib is None:
        raise SystemExit("the native kernels are unavailable: nothing to stream with")
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"cpu: {cpu}, 2 threads, torch {torch.__version__}")
    big = torch.ones((args.stream_mb << 20) // 4)
    tiny, logits = torch.zeros(4), torch.randn(1, 32000)

    def stream() -> None:
        lib.kiln_stream_sum(big.data_ptr(), big.numel(), 2)

    befores: dict[str, Callable[[], object]] = {"after a stream": stream}
    if args.engine:
        from kiln.contract import SeqChunk, pack_inputs
        from kiln.runtime import Engine

        engine = Engine.from_dir(args.engine)
        bs = engine.config.bounds.tokens_per_block
        kv = engine.allocate_kv_cache(-(-80 // bs))
        table = list(range(kv.shape[2]))
        rng = random.Random(0)
        vocab = engine.config.model.vocab_size
        engine.run(pack_inputs([SeqChunk([rng.randrange(3, vocab) for _ in range(64)], 0, table, 1)], kv, bs))
        step = pack_inputs([SeqChunk([rng.randrange(3, vocab)], 64, table, 1)], kv, bs)
        befores["after a decode step"] = lambda: engine.run(step)
    calls: dict[str, Callable[[], object]] = {
        "sum(range(10))": lambda: sum(range(10)),
        "torch.empty(4)": lambda: torch.empty(4),
        "tiny.add_(1)": lambda: tiny.add_(1),
        "torch.tensor([1, 2, 3])": lambda: torch.tensor([1, 2, 3]),
        "argmax_rows(1 x 32000)": lambda: argmax_rows(logits),
    }
    cols = ["warm", *befores]
    print(f"{'call (us, median of ' + str(args.repeats) + ')':<34}" + "".join(f"{c:>22}" for c in cols))
    for name, fn in calls.items():
        row = [median_us(fn, fn, args.repeats)] + [median_us(fn, b, args.repeats) for b in befores.values()]
        print(f"{name:<34}" + "".join(f"{v:22.1f}" for v in row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
