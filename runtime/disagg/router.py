"""Prefix-cache-aware choice of a prefill worker (the disaggregated frontend's routing).

Each prefill worker's prefix cache keys full KV blocks by a hash chained over the prompt's tokens
(``kiln.runtime.kv_cache.hash_block``), so the frontend can hash a prompt the same way and know, block for block,
how much of it a worker holds. What a worker holds it learns from the worker itself: the worker's KV manager logs
every hash it caches and evicts (``KVCacheManager.record_events``) and sends them on the control channel (with
its stats, and before each ``prefilled`` message, so the blocks of a prompt are known here once it is prefilled).
The prompts still in prefill on a worker count as held too (their blocks will be cached there), so a burst of
requests with a common prefix is not scattered before the first one's blocks are reported.

The choice is the worker whose queue would give this request its first token soonest, in prompt tokens still to
compute: ``queued(w) + len(prompt) - cached(w)``, where ``queued(w)`` sums the uncached tokens of the requests in
prefill on ``w`` and ``cached(w)`` is the prompt's longest prefix (whole blocks, leaving at least one token to
compute, as the worker's own lookup does) that ``w`` holds. With no useful prefix anywhere this is the least
loaded worker; a holder whose queue costs more than recomputing the prefix elsewhere loses to a less loaded
worker. Ties go to the worker with fewer requests in prefill, then to the one chosen least recently (so prompts
that no worker holds spread over the workers' caches instead of all landing on the first), then the lower slot.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kiln.runtime.kv_cache import hash_block


def prompt_hashes(ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hash chain of the prompt's full blocks (the keys a worker's prefix cache gives them)."""
    out: list[bytes] = []
    for i in range(len(ids) // block_size):
        out.append(hash_block(out[-1] if out else None, list(ids[i * block_size:(i + 1) * block_size])))
    return out


@dataclass(frozen=True)
class Route:
    """Where a request goes, and how many of its prompt tokens that worker is expected to find cached."""

    uid: int
    cached_tokens: int
    cost: int   # prompt tokens the worker computes before this one's first token (its queue included)


@dataclass
class _Claim:
    uid: int
    hashes: list[bytes]
    tokens: int   # the request's uncached prompt tokens (what it adds to the worker's queue)


class PrefixRouter:
    """The frontend's view of each prefill worker's prefix cache and queue. Thread-safe: events come from the
    workers' reader threads, routes from the callers' threads."""

    def __init__(self, block_size: int, enabled: bool = True):
        self.block_size = block_size
        self.enabled = enabled   # False (prefix reuse off): workers cache nothing, every prefix is computed
        self._held: dict[int, set[bytes]] = {}        # worker uid -> hashes its cache holds (as last reported)
        self._pending: dict[int, Counter] = {}        # worker uid -> hashes of the prompts in prefill there
        self._claims: dict[str, _Claim] = {}          # request id -> its claim on a worker
        self._chosen: dict[int, int] = {}             # worker uid -> when it was last chosen (a sequence number)
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def on_events(self, uid: int, events: Iterable[tuple[bool, bytes]]) -> None:
        """A worker's cache events, in the order it logged them: (True, h) cached, (False, h) evicted."""
        with self._lock:
            held = self._held.setdefault(uid, set())
            for stored, h in events:
                if stored:
                    held.add(h)
                else:
                    held.discard(h)

    def forget(self, uid: int) -> None:
        """A worker is gone (a rejoined worker has a new uid and an empty cache)."""
        with self._lock:
            self._held.pop(uid, None)
            self._pending.pop(uid, None)
            self._chosen.pop(uid, None)
            for rid in [r for r, c in self._claims.items() if c.uid == uid]:
                del self._claims[rid]

    def cached_blocks(self, uid: int, hashes: Sequence[bytes]) -> int:
        """(under ``_lock``) the leading blocks of ``hashes`` that worker ``uid`` holds or is computing."""
        held, pending = self._held.get(uid, ()), self._pending.get(uid, Counter())
        n = 0
        for h in hashes:
            if h not in held and not pending[h]:
                break
            n += 1
        return n

    def route(self, request_id: str, ids: Sequence[int], workers: Sequence[tuple[int, int]]) -> Route:
        """Pick a worker among ``workers`` ((uid, requests in prefill there), by slot order, at least one) for
        a prompt, and count the request in its queue until :meth:`release`."""
        hashes = prompt_hashes(ids, self.block_size) if self.enabled else []
        usable = hashes[:(len(ids) - 1) // self.block_size]   # the worker's lookup leaves a token to compute
        with self._lock:
            queued = Counter()
            for c in self._claims.values():
                queued[c.uid] += c.tokens
            best: tuple | None = None
            for order, (uid, requests) in enumerate(workers):
                cached = self.cached_blocks(uid, usable) * self.block_size
                cost = queued[uid] + len(ids) - cached
                key = (cost, requests, self._chosen.get(uid, -1), order)
                if best is None or key < best[0]:
                    best = (key, Route(uid, cached, cost))
            assert best is not None, "route() needs at least one worker"
            route = best[1]
            self._chosen[route.uid] = next(self._seq)
            self._claims[request_id] = _Claim(route.uid, hashes, len(ids) - route.cached_tokens)
            self._pending.setdefault(route.uid, Counter()).update(hashes)
        return route

    def release(self, request_id: str) -> None:
        """The request left prefill (handed to a decode worker, or ended): its queue share and claim go."""
        with self._lock:
            c = self._claims.pop(request_id, None)
            if c is not None and c.uid in self._pending:
                pending = self._pending[c.uid]
                pending.subtract(c.hashes)
                for h in c.hashes:
                    if pending[h] <= 0:
                        pending.pop(h, None)
