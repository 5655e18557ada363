"""KV block transport between workers: torch.distributed point-to-point (gloo on CPU), one two-rank group per
(prefill, decode) pair, made on the frontend's TCPStore.

No world-wide process group: each pair builds its own ``ProcessGroupGloo`` (prefill rank 0, decode rank 1) under
the store prefix ``kv/{prefill uid}-{decode uid}/{epoch}``. A worker that dies or restarts takes only its own
pairs with it; a restarted worker has a fresh uid, so its pairs are new groups (a gloo group cannot gain members,
but a pair can be made anew). Per pair, blocks go one way (prefill to decode), one transfer at a time, in the order
the frontend assigned them (a tag each): the prefill side sends in that order from one thread per decode peer, the
decode side receives in the order it reserved blocks, which is the same order, from one thread per prefill peer.

A transfer that fails or times out (``timeout``) fails its request; gloo closes a pair on a timeout, so both
sides then close the group and build the next epoch's, and the pair's later transfers go on that one (the other
side's pending transfer fails at once on the closed pair, so both sides step to the same epoch).
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from kiln.runtime.kv_transfer import as_bytes

logger = logging.getLogger("kiln.runtime")
CONNECT_TIMEOUT_S = 120.0   # how long one side waits for the other to build the pair's group


def connect_store(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> dist.Store:
    """A client of the frontend's TCPStore (the rendezvous of every pair's group)."""
    return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))


def serve_store(port: int = 0) -> dist.TCPStore:
    """The frontend's TCPStore: workers come and go, so it waits for none."""
    return dist.TCPStore("0.0.0.0", port, None, True, timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S),
                         wait_for_workers=False)


class PairLane:
    """One peer's transfers: a thread that builds the pair's group (at once, and again after a failure), then
    moves block tensors in order (``send`` on the prefill side, ``recv`` on the decode side).
    ``done(request_id, tensor or exception, seconds)`` is called after each transfer. ``close()``: the peer is
    gone; queued transfers fail, the thread ends."""

    def __init__(self, store: dist.Store, pair: str, rank: int, timeout_s: float,
                 done: Callable[[str, torch.Tensor | BaseException, float], None]):
        self._store, self._pair, self._rank = store, pair, rank
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._done = done
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self.epoch = 0
        threading.Thread(target=self._run, name=f"kiln-kv-{pair}", daemon=True).start()

    def put(self, request_id: str, tensor: torch.Tensor, tag: int) -> None:
        self._jobs.put((request_id, tensor, tag))

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)

    def _group(self) -> dist.ProcessGroup:
        prefix = dist.PrefixStore(f"kv/{self._pair}/{self.epoch}", self._store)
        return dist.ProcessGroupGloo(prefix, self._rank, 2, datetime.timedelta(seconds=CONNECT_TIMEOUT_S))

    def _run(self) -> None:
        group: dist.ProcessGroup | None = None
        while not self._closed:
            if group is None:   # at once, not at the first transfer: both sides are likely idle now
                try:
                    group = self._group()
                except Exception as exc:   # the peer did not come: the next transfer fails and retries
                    logger.warning("KV pair %s (epoch %d) not built: %s", self._pair, self.epoch, exc)
            job = self._jobs.get()
            if job is None:
                break
            request_id, tensor, tag = job
            t0 = time.perf_counter()
            try:
                if group is None:
                    raise ConnectionError(f"KV pair {self._pair} is not connected")
                data, peer = [as_bytes(tensor)], 1 - self._rank
                work = group.send(data, peer, tag) if self._rank == 0 else group.recv(data, peer, tag)
                work.wait(self._timeout)
                result: torch.Tensor | BaseException = tensor
            except Exception as exc:   # the peer is gone, or the transfer timed out: only this request fails
                result = exc
                group = None           # gloo closed the pair: build the next epoch's group
                self.epoch += 1
            self._done(request_id, result, time.perf_counter() - t0)
        while True:   # closed: what was queued fails
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._done(job[0], ConnectionError(f"the peer of KV pair {self._pair} is gone"), 0.0)
