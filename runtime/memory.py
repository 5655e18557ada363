"""Resident memory of a serving process, held against what the engine needs.

What a process serving an engine must hold: its weights (once), its KV pool and the activations of its
largest step (the builder's planned peak). :class:`MemoryCheck` compares the growth of the process's
peak resident set over a baseline (the interpreter with torch, kiln, its kernel library and the engine
loader's torch modules imported: :func:`prepare_baseline`) with
``RSS_BOUND_FACTOR`` times that need; ``kiln inspect --load`` and the benchmarks print it. Linux's
``/proc/self/status`` gives the current and peak resident set, and ``/proc/self/clear_refs`` resets the
peak, so the peak of one phase (loading and serving) is measured apart from the imports before it.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from kiln.contract import SeqChunk, human_bytes, pack_inputs

__all__ = ["RSS_BOUND_FACTOR", "MemoryCheck", "resident_bytes", "reset_peak_resident", "prepare_baseline",
           "largest_step_check"]

# Allowance over weights + KV pool + activation peak: allocator slack, the graph's own buffers, the
# tokenizer and the runtime's bookkeeping. A second copy of the weights cannot fit under it.
RSS_BOUND_FACTOR = 1.15


def resident_bytes() -> tuple[int, int]:
    """(current, peak) resident set of this process in bytes (peak since start or the last reset)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: the peak only (ru_maxrss is KiB on Linux, B on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak, peak


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``): loading an engine (checksums,
    JSON, the tokenizer, the compiled package) leaves ~10 MB of freed heap that would otherwise stay resident for
    the process's life. False where the C library has no such call."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def reset_peak_resident() -> bool:
    """Reset the peak resident set to the current one (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class MemoryCheck:
    """Peak resident growth over a baseline, against RSS_BOUND_FACTOR x (weights + KV pool + activations)."""

    baseline_bytes: int     # resident before the engine was loaded (interpreter, torch, kiln)
    peak_bytes: int         # peak resident since then
    weights_bytes: int
    kv_pool_bytes: int
    activation_bytes: int   # the build's planned activation peak

    @property
    def growth_bytes(self) -> int:
        return self.peak_bytes - self.baseline_bytes

    @property
    def need_bytes(self) -> int:
        return self.weights_bytes + self.kv_pool_bytes + self.activation_bytes

    @property
    def bound_bytes(self) -> int:
        return int(RSS_BOUND_FACTOR * self.need_bytes)

    @property
    def within_bound(self) -> bool:
        return self.growth_bytes <= self.bound_bytes

    def summary(self) -> str:
        return (f"peak RSS {human_bytes(self.peak_bytes)} = baseline {human_bytes(self.baseline_bytes)} + "
                f"{human_bytes(self.growth_bytes)}; bound {RSS_BOUND_FACTOR} x (weights "
                f"{human_bytes(self.weights_bytes)} + KV pool {human_bytes(self.kv_pool_bytes)} + activations "
                f"{human_bytes(self.activation_bytes)}) = {human_bytes(self.bound_bytes)}: "
                f"{'within' if self.within_bound else 'OVER'} ({self.growth_bytes / max(1, self.need_bytes):.2f} x)")

    def to_dict(self) -> dict:
        return {"baseline_bytes": self.baseline_bytes, "peak_bytes": self.peak_bytes,
                "growth_bytes": self.growth_bytes, "weights_bytes": self.weights_bytes,
                "kv_pool_bytes": self.kv_pool_bytes, "activation_bytes": self.activation_bytes,
                "bound_bytes": self.bound_bytes, "within_bound": self.within_bound}


def prepare_baseline(backend: str) -> None:
    """Load what every process serving a ``backend`` engine holds whatever the engine: the kernel library
    and the torch modules that load engines. The resident set after this is the baseline."""
    from kiln.plugins.native import native_kernels_available
    from kiln.runtime.engine import import_loader

    native_kernels_available()
    import_loader(backend)


def largest_step_check(engine_dir) -> MemoryCheck:
    """Load the engine, run its largest step (max_num_tokens prompt tokens in as few sequences as the bounds
    allow, with a KV pool just big enough) and measure the peak resident growth that took."""
    from kiln.runtime.engine import Engine

    prepare_baseline(Engine.read_config(engine_dir).backend)
    baseline, _ = resident_bytes()
    reset_peak_resident()
    engine = Engine.from_dir(engine_dir)
    b = engine.config.bounds
    per_seq = min(b.max_input_len, b.max_seq_len)
    lens, left = [], b.max_num_tokens
    while left > 0 and len(lens) < b.max_batch_size:
        lens.append(min(per_seq, left))
        left -= lens[-1]
    bs = b.tokens_per_block
    tables, next_block = [], 0
    for n in lens:
        blocks = -(-n // bs)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    kv = engine.allocate_kv_cache(next_block)
    vocab = engine.config.model.vocab_size
    chunks = [SeqChunk([(7 * i + j) % vocab for j in range(n)], 0, t) for i, (n, t) in enumerate(zip(lens, tables))]
    try:
        engine.run(pack_inputs(chunks, kv, bs, b.max_blocks_per_seq))
        _, peak = resident_bytes()
    finally:
        engine.close()   # a tensor-parallel engine's other ranks (this process's numbers are rank 0's)
    return MemoryCheck(baseline, peak, engine.weights_bytes, kv.numel() * kv.element_size(),
                       engine.config.memory.activation_peak_bytes)
