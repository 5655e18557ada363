"""Work that runs OpenMP loops off the step loop's thread, on a thread that ends with it.

libgomp gives every thread that starts a parallel region a thread team of its own, kept for that thread's life.
The step loop's thread has one; a second team in the process (the main thread's, after it ran the load-time
autotune or built an engine with torch's or kiln's parallel kernels) puts more OpenMP threads than CPUs on the
machine, and libgomp then stops spinning between parallel regions: every region of a decode step (~180) pays a
sleep and a wake-up for the rest of the process's life. Measured on Zen 4 (2 cores): int4 246M single-stream
decode 84 tok/s in the process that ran the autotune, 202 in the next one; ``kiln serve CHECKPOINT`` right after
building it, 2-layer model, 720-900 tok/s against 1420-1900 when the engine came from the cache. A team goes with
its thread, so such work runs here.

Work outside kiln can still do it: a torch operation with a parallel loop on any other thread of the process (the
application's own). :class:`TeamWatch` notices it on the step loop's thread, by timing empty parallel regions of its
team, and says so once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kiln.plugins import native

__all__ = ["on_own_thread", "region_us", "TeamWatch", "CONTENDED_REGION_US"]

logger = logging.getLogger("kiln.runtime")

# An empty parallel region costs about a microsecond while the team's workers spin between regions (0.8-1.1 us on
# Zen 4 and Sapphire Rapids) and a sleep plus a wake-up once libgomp has stopped spinning: over ten times that on
# Zen 4 (docs/benchmarks.md, "OpenMP teams"), 5-80 us on Sapphire Rapids, whose fastest wake-ups (5.0-5.9 us) sat at
# the 5 us this threshold was first.
CONTENDED_REGION_US = 3.0


def on_own_thread(fn: Callable[..., Any], *args: Any, name: str = "kiln-work", **kwargs: Any) -> Any:
    """fn(*args, **kwargs) on a new thread, joined (the pool's shutdown ends it); its result, or its exception
    raised here."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def region_us(nthreads: int) -> float | None:
    """Median microseconds of an empty parallel region of ``nthreads`` on the calling thread's team (~1.6 ms of
    probing); None without the native library."""
    lib = native.library()
    return None if lib is None else float(lib.kiln_openmp_region_us(int(nthreads)))


class TeamWatch:
    """Checks, at most every ``interval_s``, on the thread that calls :meth:`check` (the step loop's), whether its
    OpenMP team has stopped spinning between parallel regions, and logs a warning the first time two checks in a
    row found it so (one slow probe can be a busy machine descheduling the team's worker)."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self.region_us: float | None = None   # the last measurement
        self._next = 0.0
        self._slow_checks = 0
        self._warned = False

    @property
    def contended(self) -> bool:
        return self._slow_checks >= 2

    def check(self, nthreads: int | None = None) -> None:
        """Probe if it is time (``nthreads``: the team's size, torch's thread count by default)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        nthreads = torch.get_num_threads() if nthreads is None else nthreads
        if nthreads < 2:
            return
        self.region_us = region_us(nthreads)
        slow = self.region_us is not None and self.region_us > CONTENDED_REGION_US
        self._slow_checks = self._slow_checks + 1 if slow else 0
        if self.contended and not self._warned:
            self._warned = True
            logger.warning(
                "another thread of this process has an OpenMP team (it ran a parallel torch or OpenMP operation), so "
                "this process has more OpenMP threads than CPUs and libgomp has stopped spinning between parallel "
                "regions: each region of kiln's steps now waits for a sleeping thread (%.1f us against ~1), and "
                "decode runs up to ~2x slower. Run such work in another process, or on a thread that ends when it "
                "is done (kiln.plugins.openmp_teams.on_own_thread); a team lives as long as its thread.",
                self.region_us)
