"""What verifying an engine's checksums costs at load (benchmark, not a test).

    .venv/bin/python scripts/bench_engine_load.py [--engine DIR] [--size 246m] [--repeat 3]

Without --engine, builds (once, into work/bench/engine-load-<size>) the fp32 engine of the random Llama of
``size`` (246m: a ~1 GB rank0.engine). Times, median of --repeat (the cases interleaved), with the engine's
pages in the page cache ("warm") and evicted first with posix_fadvise(DONTNEED) on these files only ("cold"):

  read        reading the files once (the floor of any check)
  sha256      file_checksum of every checksummed file (what verification adds)
  load        Engine.from_dir(verify=False)
  verify+load Engine.from_dir() (the default)

Timings on a shared 2-core machine are noisy: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench_common import ensure_checkpoint, ensure_engine


def evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)   # pages not yet written back would stay cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(paths: list[Path]) -> None:
    buf = bytearray(1 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, help="engine directory (default: build the --size Llama's)")
    ap.add_argument("--size", default="246m", help="random Llama preset to build when no --engine is given")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    from kiln.contract import file_checksum, read_engine_config
    from kiln.runtime import Engine

    engine_dir = args.engine or ensure_engine(
        f"engine-load-{args.size}", dict(max_batch_size=4, max_input_len=64, max_seq_len=128, max_num_tokens=128),
        ensure_checkpoint(args.size))
    config = read_engine_config(engine_dir)
    paths = [engine_dir / name for name in config.checksums]
    size = sum(p.stat().st_size for p in paths)
    Engine.from_dir(engine_dir, verify=False)   # native kernels loaded/compiled once, outside the timings
    cases = {
        "read": lambda: read_all(paths),
        "sha256": lambda: [file_checksum(p) for p in paths],
        "load": lambda: Engine.from_dir(engine_dir, verify=False),
        "verify+load": lambda: Engine.from_dir(engine_dir),
    }
    print(f"{engine_dir}: {len(paths)} checksummed files, {size / 1e9:.3f} GB")
    times: dict[tuple[str, str], list[float]] = {(name, cache): [] for name in cases for cache in ("warm", "cold")}
    for _ in range(args.repeat):   # the cases interleaved, so a busy moment of the machine hits all of them
        for cache in ("warm", "cold"):
            for name, fn in cases.items():
                if cache == "cold":
                    evict(paths)
                else:
                    read_all(paths)
                t0 = time.perf_counter()
                fn()
                times[name, cache].append(time.perf_counter() - t0)
    print(f"median of {args.repeat}   {'warm s':>8} {'cold s':>8}")
    for name in cases:
        print(f"{name:16} {statistics.median(times[name, 'warm']):8.2f} {statistics.median(times[name, 'cold']):8.2f}")

if __name__ == "__main__":
    main()
