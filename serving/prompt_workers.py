"""A small thread pool for the prompt work that can take long: parsing a large request body, rendering a chat
template, tokenizing. It keeps that work off the thread that serves everyone else (the HTTP event loop, Triton's
``execute``), bounds how much of it runs and waits at once, and gives the memory it used back to the system.

Small jobs (under ``inline_bytes`` of input) run in the caller's thread: a thread hop would cost them more than
the work. After a job of ``trim_bytes`` or more, glibc's ``malloc_trim`` returns the freed heap to the system:
tokenizing megabytes leaves hundreds of MB free but mapped in the worker threads' malloc arenas, which the
process would otherwise keep (RSS stays at its peak). It runs once in the worker right after the job, and once
more ``TRIM_DELAY_S`` after the last one, when the request that held the input (its body, its tensors) has been
answered and freed.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

INLINE_BYTES = 1 << 10
TRIM_BYTES = 1 << 20
TRIM_DELAY_S = 1.0


def _malloc_trim() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)`` (ctypes releases the GIL around it), or a no-op where there is no glibc."""
    path = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(path).malloc_trim if path else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class Busy(Exception):
    """The jobs already submitted hold ``max_pending_bytes`` of input: refuse the request (429 / UNAVAILABLE)."""


class PromptWorkers:
    """``workers`` threads for large prompt jobs. Jobs wait for a thread in order, as long as all the jobs
    submitted and not finished hold at most ``max_pending_bytes`` of input (what bounds their memory; one job is
    always taken)."""

    def __init__(self, workers: int = 1, max_pending_bytes: int = 64 << 20, inline_bytes: int = INLINE_BYTES,
                 trim_bytes: int = TRIM_BYTES, name: str = "kiln-prompt"):
        if workers < 1 or max_pending_bytes < 0:
            raise ValueError(f"workers must be >= 1 and max_pending_bytes >= 0, got {workers} and "
                             f"{max_pending_bytes}")
        self.workers, self.max_pending_bytes = workers, max_pending_bytes
        self.inline_bytes, self.trim_bytes = inline_bytes, trim_bytes
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._jobs = 0       # submitted and not finished
        self._pending = 0    # their bytes of input
        self._trim = _malloc_trim()
        self._trim_timer: threading.Timer | None = None

    @property
    def jobs(self) -> int:
        return self._jobs

    def submit(self, fn: Callable[..., T], *args, size: int) -> Future:
        """Run ``fn(*args)`` in a worker (``size``: the bytes of input it works on); Busy if that is too much."""
        with self._lock:
            if self._jobs and self._pending + size > self.max_pending_bytes:
                raise Busy(f"{self._jobs} large prompts ({self._pending >> 20} MiB) are already being prepared; "
                           "retry later")
            self._jobs += 1
            self._pending += size
        done = functools.partial(self._finished, size)
        try:
            future = self._pool.submit(self._call, fn, args, size)
        except BaseException:
            done()
            raise
        future.add_done_callback(done)   # also when cancelled before it ran
        return future

    async def run(self, fn: Callable[..., T], *args, size: int) -> T:
        """``fn(*args)``: here if ``size`` is small, else in a worker while the event loop goes on."""
        if size < self.inline_bytes:
            return fn(*args)
        return await asyncio.wrap_future(self.submit(fn, *args, size=size))

    def _call(self, fn, args, size: int):
        try:
            return fn(*args)
        finally:
            if size >= self.trim_bytes:
                self._trim()
                self._trim_later()

    def _trim_later(self) -> None:
        """Trim TRIM_DELAY_S after the last large job (a flood of them is trimmed after each, in the worker)."""
        with self._lock:
            if self._trim_timer is not None:
                self._trim_timer.cancel()
            self._trim_timer = threading.Timer(TRIM_DELAY_S, self._trim)
            self._trim_timer.daemon = True
            self._trim_timer.start()

    def _finished(self, size: int, _future: Future | None = None) -> None:
        with self._lock:
            self._jobs -= 1
            self._pending -= size

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            if self._trim_timer is not None:
                self._trim_timer.cancel()
