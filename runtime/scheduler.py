"""Scheduler: decides, one step at a time, which requests run and how many of their tokens.

There are no phase flags. A request has ``num_tokens`` (prompt + generated) and ``num_computed_tokens``
(tokens whose KV is in the pool); each step it is given up to ``num_tokens - num_computed_tokens`` new
tokens. A full prompt, a prefill chunk, a recompute after preemption and a decode step are the same thing
with different counts, and prefix reuse simply starts ``num_computed_tokens`` further on.

Per step, within ``max_batch_size`` sequences and ``max_num_tokens`` tokens:

1. running requests, decodes first (then unfinished prefills), higher priority / earlier arrival first;
2. waiting requests in priority order (higher first, FCFS within a priority), admitted while budget,
   KV blocks and the capacity policy allow; the queue head blocks the rest (no overtaking).

Chunks of a long prompt end on block boundaries, except the last one.

Capacity policies:

* ``guaranteed_no_evict``: a request is admitted only if the pool can hold its prompt + max_tokens on top
  of what every running request may still need, so a running request never runs out of blocks.
* ``max_utilization``: admit whenever the next chunk fits; when a running request needs a block and none is
  free, preempt the lowest-priority, latest-arrived running request not yet scheduled in this step (possibly
  itself): its blocks are freed and it waits to be recomputed (its prefix may still be cached).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

from kiln.contract import InvalidRequestError
from kiln.runtime.kv_cache import KVCacheManager, cdiv
from kiln.runtime.request import Request, RequestStatus

logger = logging.getLogger("kiln.runtime")

CAPACITY_POLICIES = ("guaranteed_no_evict", "max_utilization")


@dataclass
class SchedulerConfig:
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    max_input_len: int
    capacity_policy: str = "guaranteed_no_evict"

    def __post_init__(self) -> None:
        if self.capacity_policy not in CAPACITY_POLICIES:
            raise ValueError(f"capacity_policy must be one of {CAPACITY_POLICIES}, got {self.capacity_policy!r}")
        if self.max_batch_size < 1 or self.max_num_tokens < 1:
            raise ValueError("max_batch_size and max_num_tokens must be >= 1")


@dataclass
class ScheduledRequest:
    request: Request
    start: int              # num_computed_tokens before this step (position of the first new token)
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Does this step reach the request's last token (so its logits give the next token)?"""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)   # context chunks first, then decodes
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.waiting: list[Request] = []     # sorted by order_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_finished = 0

    # ---- admission checks -----------------------------------------------------------------------------
    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Effective max_tokens, or InvalidRequestError if the request can never be served."""
        c = self.config
        if num_prompt_tokens < 1:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        if num_prompt_tokens > c.max_input_len:
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens, more than the engine's max_input_len {c.max_input_len}; "
                "shorten the prompt or rebuild the engine with a larger --max-input-len")
        if max_tokens is None:  # as many as the engine and the whole pool allow
            max_tokens = min(c.max_seq_len, self.kv.num_blocks * self.block_size + 1) - num_prompt_tokens
            if max_tokens < 1:
                raise InvalidRequestError(
                    f"prompt has {num_prompt_tokens} tokens: no room to generate within max_seq_len {c.max_seq_len}")
        elif num_prompt_tokens + max_tokens > c.max_seq_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {num_prompt_tokens + max_tokens} "
                f"exceeds the engine's max_seq_len {c.max_seq_len}; lower max_tokens to at most "
                f"{max(c.max_seq_len - num_prompt_tokens, 0)} or rebuild with a larger --max-seq-len")
        need = self.blocks_for_request(num_prompt_tokens, max_tokens)
        if need > self.kv.num_blocks:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens}) + max_tokens ({max_tokens}) needs {need} KV blocks but the whole pool "
                f"has {self.kv.num_blocks} ({self.kv.num_blocks * self.block_size} tokens); lower max_tokens or "
                "give the KV cache more memory (kv_cache_memory_fraction / max_kv_cache_tokens)")
        return max_tokens

    def blocks_for_request(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Blocks a request holds at its longest (the last generated token is never fed back)."""
        return cdiv(num_prompt_tokens + max_tokens - 1, self.block_size)

    # ---- queue management -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        keys = [r.order_key for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.order_key), request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (any state): free its blocks and forget it."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        request.metrics.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)
        self.num_finished += 1

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)
        logger.debug("preempted %s", request.request_id)

    def _reserved_blocks(self) -> int:
        """Blocks running requests may still claim (guaranteed_no_evict's promise to them)."""
        return sum(max(0, self.blocks_for_request(r.num_prompt_tokens, r.max_tokens) - len(r.block_ids))
                   for r in self.running)

    def _chunk(self, start: int, num_tokens: int, budget: int) -> int:
        remaining = num_tokens - start
        if remaining <= budget:
            return remaining
        end = (start + budget) // self.block_size * self.block_size
        return max(0, end - start)

    # ---- one step -------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        c, kv = self.config, self.kv
        out = SchedulerOutput()
        budget, seats = c.max_num_tokens, c.max_batch_size
        scheduled: set[int] = set()
        now = time.monotonic()

        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.order_key))
        for req in order:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget <= 0 or seats <= 0:
                break
            n = self._chunk(req.num_computed_tokens, req.num_tokens, budget)
            if n == 0:
                continue
            while not kv.allocate_slots(req, n):
                if c.capacity_policy != "max_utilization":
                    logger.warning("guaranteed_no_evict: %s found no free block; it waits a step", req.request_id)
                    break
                candidates = [r for r in self.running if id(r) not in scheduled]
                victim = max(candidates, key=lambda r: r.order_key)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.add(id(req))
                out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n))
                budget -= n
                seats -= 1

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < c.max_batch_size:
                req = self.waiting[0]
                hits = kv.find_cached_prefix(req)
                start = len(hits) * self.block_size
                n = self._chunk(start, req.num_tokens, budget)
                if n == 0:
                    break
                new_blocks = cdiv(start + n, self.block_size) - len(hits)
                taken = kv.num_evictable_in(hits)
                if c.capacity_policy == "guaranteed_no_evict":
                    need = self.blocks_for_request(req.num_prompt_tokens, req.max_tokens) - len(hits)
                    if need > kv.num_free_blocks - taken - self._reserved_blocks():
                        break
                elif new_blocks > kv.num_free_blocks - taken:
                    break
                self.waiting.pop(0)
                kv.acquire_prefix(req, hits)
                ok = kv.allocate_slots(req, n)
                assert ok, "admission check and allocation disagree"
                req.status = RequestStatus.RUNNING
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
                    req.metrics.num_cached_tokens = start
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, start, n))
                budget -= n

        out.scheduled.sort(key=lambda s: s.num_new_tokens == 1)  # context chunks first (stable)
        for s in out.scheduled:
            if s.num_new_tokens == 1 and s.samples and s.request.num_output_tokens > 0:
                out.num_decode_tokens += 1
            else:
                out.num_prefill_tokens += s.num_new_tokens
        return out

    # ---- after the forward ----------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Request]:
        """Advance progress; append sampled tokens (``sampled``: index in ``out.scheduled`` -> token id);
        finish requests on EOS, stop token ids, max_tokens or max_seq_len. Returns the finished ones."""
        finished = []
        for i, s in enumerate(out.scheduled):
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req)
            token = sampled.get(i)
            if token is None:
                continue
            req.append_token(token)
            status = self.check_stop(req, token)
            if status is not None:
                self.finish(req, status)
                finished.append(req)
        return finished

    def check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens > p.min_tokens:  # at least min_tokens tokens come before a stop token
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_seq_len:
            return RequestStatus.FINISHED_LENGTH
        return None
