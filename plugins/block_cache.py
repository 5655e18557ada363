"""Reuse of large CPU blocks: torch's CPU allocator, replaced once the native library loads, keeps freed tensors
of at least ``KILN_CPU_BLOCK_CACHE_MIN_MB`` (default 16) for the next tensor of about their size, up to
``KILN_CPU_BLOCK_CACHE_MB`` (default 1024; 0 = off) in all.

Without it glibc gives every allocation above its mmap threshold (at most 32 MB) fresh pages and returns them on
free, so a prefill step's largest activations fault and zero their pages again inside the GEMM that first writes
them, every step (``csrc/block_cache.cpp`` has the measurement). Smaller tensors are torch's default allocator's,
as before. The cached blocks stay resident: after a long prompt the process keeps up to the cap of its peak.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

__all__ = ["BlockCacheStats", "install", "stats", "configured_bounds"]

_MB = 1 << 20


@dataclass(frozen=True)
class BlockCacheStats:
    cap_bytes: int
    min_bytes: int
    cached_bytes: int
    cached_blocks: int
    hits: int
    misses: int


def configured_bounds() -> tuple[int, int]:
    """(cap, min) in bytes from ``KILN_CPU_BLOCK_CACHE_MB`` / ``KILN_CPU_BLOCK_CACHE_MIN_MB``."""
    def mb(name: str, default: float) -> int:
        raw = os.environ.get(name, "").strip()
        try:
            value = float(raw) if raw else default
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number of MiB (e.g. {name}={default:g}; 0 turns the "
                             "block cache off)") from None
        if value < 0:
            raise ValueError(f"{name}={raw!r} is negative; give MiB >= 0")
        return int(value * _MB)
    return mb("KILN_CPU_BLOCK_CACHE_MB", 1024), max(mb("KILN_CPU_BLOCK_CACHE_MIN_MB", 16), 1)


def install(lib: ctypes.CDLL, cap_bytes: int | None = None, min_bytes: int | None = None) -> bool:
    """Make the cache torch's CPU allocator with these bounds (default: the environment's); True when it is.
    A cap of 0 with no cache installed yet leaves torch's allocator alone."""
    env_cap, env_min = configured_bounds()
    cap = env_cap if cap_bytes is None else int(cap_bytes)
    low = env_min if min_bytes is None else int(min_bytes)
    if cap <= 0 and stats(lib) is None:
        return False
    return lib.kiln_block_cache_install(cap, low) == 0


def stats(lib: ctypes.CDLL) -> BlockCacheStats | None:
    """The cache's bounds, contents and hit counts; None when it was never installed."""
    out = (ctypes.c_int64 * 6)()
    if lib.kiln_block_cache_stats(out) != 0:
        return None
    return BlockCacheStats(*out)
