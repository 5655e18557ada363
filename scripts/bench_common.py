"""What the benchmark scripts share: timestamped progress lines, the ~300M Llama checkpoint, the check
that an engine left by an earlier run was built by today's builder, the timed decode steps of a paged batch
(``engine.run`` alone) and the streaming-read rate that decode steps are compared with."""

from __future__ import annotations

import fcntl
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "work" / "bench"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def best_per_call_s(fn, calls: int, repeats: int, warmup: int = 1) -> float:
    """Seconds per call of ``fn``: the best of ``repeats`` timed loops of ``calls`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def checkpoint_dir(size: str = "300m") -> Path:
    return BENCH / f"llama-{size}"


CKPT = checkpoint_dir()  # the default size, shared by the benchmarks


def ensure_checkpoint(size: str = "300m", train_steps: int = 0, train_seq_len: int = 64) -> Path:
    """Create the random Llama of ``size`` (a synthetic_checkpoints preset) once; ``train_steps`` > 0: fitted to
    the synthetic corpus for that many steps of ``train_seq_len``-token windows first (its own folder). A lock
    keeps two benchmarks from writing it together."""
    BENCH.mkdir(parents=True, exist_ok=True)
    name = f"llama-{size}" + (f"-corpus{train_steps}" if train_steps else "")
    name += f"x{train_seq_len}" if train_steps and train_seq_len != 64 else ""
    ckpt = BENCH / name
    with open(BENCH / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (ckpt / "config.json").exists():
            from synthetic_checkpoints import make_checkpoint

            fitted = f", fitted to the synthetic corpus for {train_steps} steps" if train_steps else ""
            log(f"creating a {size} Llama checkpoint in {ckpt}{fitted} (once) ...")
            make_checkpoint(ckpt, "llama", size, train_steps=train_steps, train_seq_len=train_seq_len)
    return ckpt


def _builder_sources_mtime() -> float:
    """Newest modification time of the code that decides what an engine holds (passes, plugin
    layouts, model definitions)."""
    files = [f for d in ("builder", "contract", "plugins", "model_defs") for f in (ROOT / d).rglob("*.py")]
    return max(f.stat().st_mtime for f in files)


def engine_is_current(engine_dir: Path, build: dict) -> bool:
    """True if ``engine_dir`` holds an engine this kiln loads, built with ``build``'s values by the current
    builder (same pass list, built after the last change to the builder, contract, plugin or
    model-definition sources): an engine from an older builder would not measure today's kiln, so
    benchmarks rebuild it."""
    from kiln.builder.passes import PASS_NAMES
    from kiln.contract import EngineLoadError, read_build_report, read_engine_config

    try:
        config = read_engine_config(engine_dir)
    except EngineLoadError:
        return False
    report = read_build_report(engine_dir)
    if report is None or (engine_dir / "config.json").stat().st_mtime < _builder_sources_mtime():
        return False
    # values left to the builder (None / "auto") are stored resolved: they match whatever it chose
    return (all(config.build.get(k) == v for k, v in build.items() if v not in (None, "auto"))
            and list(report["passes"]) == PASS_NAMES)


def ensure_engine(name: str, build: dict, ckpt: Path = CKPT) -> Path:
    """``work/bench/<name>``: an engine of ``ckpt`` with ``build`` (BuildConfig values), built unless a
    current one is there."""
    from kiln.builder import BuildConfig, build_engine

    out = BENCH / name
    if engine_is_current(out, build):
        log(f"reusing engine {out}")
        return out
    log(f"building engine {out} ...")
    build_engine(ckpt, out, BuildConfig(**build), progress=lambda stage, msg: log(f"  build {stage}: {msg}"))
    return out


def decode_step_times(engine, batch: int, steps: int, context: int = 128, lora_slots: list[int] | None = None,
                      lora_weights=None) -> list[float]:
    """Seconds of each of ``steps`` decode steps (``engine.run`` alone: no scheduler or sampler) of ``batch``
    sequences after a prefill of ``context`` random tokens each, in a KV pool of their own. An engine taking
    adapters needs ``lora_weights`` (the adapter pool) and ``lora_slots`` (each sequence's slot; default none)."""
    import random

    from kiln.contract import NO_ADAPTER, SeqChunk, pack_inputs

    bs = engine.config.bounds.tokens_per_block
    per_seq = -(-(context + steps + 1) // bs)
    kv = engine.allocate_kv_cache(batch * per_seq)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
    rng = random.Random(0)
    vocab = engine.config.model.vocab_size
    seq_slots = lora_slots or [NO_ADAPTER] * batch

    def step(tokens: list[list[int]], start: int) -> dict:
        chunks = [SeqChunk(t, start, tables[s], 1, seq_slots[s]) for s, t in enumerate(tokens)]
        return pack_inputs(chunks, kv, bs, lora_weights=lora_weights)

    engine.run(step([[rng.randrange(3, vocab) for _ in range(context)] for _ in range(batch)], 0))
    times = []
    for i in range(steps):
        inputs = step([[rng.randrange(3, vocab)] for _ in range(batch)], context + i)
        t0 = time.perf_counter()
        engine.run(inputs)
        times.append(time.perf_counter() - t0)
    return times


def stream_read_bandwidth(nbytes: int = 64 << 20, repeats: int = 7, threads: int | None = None) -> float:
    """Best-of-``repeats`` GB/s of a pure streaming read of ``nbytes`` with ``threads`` threads
    (default: torch's), the bound a batch-1 decode GEMV is compared with (weights bytes / GB/s).
    Uses the native library's read kernel (falls back to ``torch.sum``, which reads slower)."""
    import torch

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    stream_read_rate(buf, threads)
    return max(stream_read_rate(buf, threads) for _ in range(repeats))


def stream_read_rate(buf, threads: int | None = None) -> float:
    """GB/s of one streaming read of the fp32 tensor ``buf`` (benchmarks interleave these reads with
    the steps they measure, so that both see the same share of a shared machine's memory bus)."""
    import torch

    from kiln.plugins import native

    nt = threads or torch.get_num_threads()
    lib = native.library()
    t0 = time.perf_counter()
    if lib is not None:
        lib.kiln_stream_sum(buf.data_ptr(), buf.numel(), nt)
    else:
        float(buf.sum())
    return buf.numel() * 4 / (time.perf_counter() - t0) / 1e9
