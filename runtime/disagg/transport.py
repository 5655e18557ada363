"""KV block transport between workers: torch.distributed point-to-point (gloo on CPU) on one group per
(prefill, decode) pair.

Ranks: prefill worker i is rank i, decode worker j is rank P + j (world P + D; the frontend takes no rank, it
hosts the TCPStore the workers rendezvous on). Every pair gets its own gloo group (its own sockets), so a worker
that dies breaks only the groups it is in: the others keep moving blocks. Per pair, blocks go one way (prefill
to decode), one transfer at a time, in the order the frontend assigned them (a tag each): the prefill side sends
in that order from one thread per decode peer, the decode side receives in the order it reserved blocks, which
is the same order, from one thread per prefill peer; so no pair can wait on a transfer the other side has not
reached.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from kiln.runtime.kv_transfer import as_bytes


def rank_of(role: str, index: int, num_prefill: int) -> int:
    return index if role == "prefill" else num_prefill + index


def join(host: str, port: int, rank: int, num_prefill: int, num_decode: int,
         timeout_s: float) -> dict[tuple[int, int], dist.ProcessGroup]:
    """Join the workers' world over the frontend's TCPStore and make every pair's group (all ranks make every
    group, in the same order: group creation is collective). Returns this rank's groups by (prefill, decode)."""
    world = num_prefill + num_decode
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world + 1, False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    mine = {}
    for p in range(num_prefill):
        for d in range(num_decode):
            group = dist.new_group([p, num_prefill + d], timeout=timeout, backend="gloo")
            if rank in (p, num_prefill + d):
                mine[(p, d)] = group
    return mine


class PeerLane:
    """One thread moving block tensors to (or from) one peer, in order. ``job()`` returns the tensor moved;
    ``done(tag, tensor or exception, seconds)`` is called after each."""

    def __init__(self, name: str, move: Callable[[torch.Tensor, int], None],
                 done: Callable[[str, torch.Tensor | BaseException, float], None]):
        self._move, self._done = move, done
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def put(self, request_id: str, tensor: torch.Tensor, tag: int) -> None:
        self._jobs.put((request_id, tensor, tag))

    def _run(self) -> None:
        while True:
            request_id, tensor, tag = self._jobs.get()
            t0 = time.perf_counter()
            try:
                self._move(as_bytes(tensor), tag)
                result: torch.Tensor | BaseException = tensor
            except Exception as exc:   # the peer is gone, or the transfer timed out: only this request fails
                result = exc
            self._done(request_id, result, time.perf_counter() - t0)


def sender(group: dist.ProcessGroup, peer_rank: int) -> Callable[[torch.Tensor, int], None]:
    return lambda data, tag: dist.send(data, dst=peer_rank, group=group, tag=tag)


def receiver(group: dist.ProcessGroup, peer_rank: int) -> Callable[[torch.Tensor, int], None]:
    return lambda data, tag: dist.recv(data, src=peer_rank, group=group, tag=tag)
