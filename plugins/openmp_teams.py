"""Work that runs OpenMP loops off the step loop's thread, on a thread that ends with it.

libgomp gives every thread that starts a parallel region a thread team of its own, kept for that thread's life.
The step loop's thread has one; a second team in the process (the main thread's, after it ran the load-time
autotune or built an engine with torch's or kiln's parallel kernels) puts more OpenMP threads than CPUs on the
machine, and libgomp then stops spinning between parallel regions: every region of a decode step (~180) pays a
sleep and a wake-up for the rest of the process's life. Measured on Zen 4 (2 cores): int4 246M single-stream
decode 84 tok/s in the process that ran the autotune, 202 in the next one; ``kiln serve CHECKPOINT`` right after
building it, 2-layer model, 720-900 tok/s against 1420-1900 when the engine came from the cache. A team goes with
its thread, so such work runs here.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["on_own_thread"]


def on_own_thread(fn: Callable[..., Any], *args: Any, name: str = "kiln-work", **kwargs: Any) -> Any:
    """fn(*args, **kwargs) on a new thread, joined (the pool's shutdown ends it); its result, or its exception
    raised here."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) as pool:
        return pool.submit(fn, *args, **kwargs).result()
