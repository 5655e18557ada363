"""Scheduler: decides, one step at a time, which requests run and how many of their tokens.

There are no phase flags. A request has ``num_tokens`` (prompt + generated) and ``num_computed_tokens``
(tokens whose KV is in the pool); each step it is given up to ``num_tokens - num_computed_tokens`` new
tokens. A full prompt, a prefill chunk, a recompute after preemption and a decode step are the same thing
with different counts, and prefix reuse simply starts ``num_computed_tokens`` further on.

The scheduler is the only writer of a request's progress, status and finish time: it admits, advances
(:meth:`update_from_output`), preempts and ends requests (:meth:`finish_requests`, also for aborts and
stop strings). The KV cache manager holds the blocks.

Per step, within ``max_batch_size`` sequences and ``max_num_tokens`` tokens:

1. running requests' decodes, higher priority / earlier arrival first;
2. prefills: running requests' unfinished prompts and waiting requests in one order (higher priority first,
   then earlier arrival), waiting ones admitted while budget, KV blocks and the capacity policy allow; the
   queue head blocks the rest of the queue (no overtaking). A waiting request that ranks before a running
   prompt (a higher priority, a short prompt within its lead) so takes the budget before that prompt's next
   chunk.

Three knobs shape steps under load (ExecutorConfig turns the pace and the lead on by default):

* ``tpot_target_s``: the pace every decoding stream is held to. A decoding request that has ``g`` tokens,
  the first at ``t1``, may wait through a step of up to ``g x target - (now - t1)`` seconds and still have
  averaged the target over its tokens when the step ends: the time it is ahead of its pace (its own decode
  steps are usually much shorter than the target) is banked and spent on prefill beside it. A step that
  carries decodes takes at most the tokens that fit the smallest bank (the engine's step time ``a + b x
  tokens``, fitted as it serves: ``step_time``), and at least one block of prefill beside its decodes. At
  light load the banks are large and a prompt arriving next to running streams is prefilled at once (its
  TTFT is its own prefill); under load the banks run dry and prefill chunks shrink to what keeps every stream
  at the pace (its TPOT). Without a step time (``step_time`` None) the steps are not paced; requests whose
  tokens nobody reads as they come (``Request.paced`` False: batch work, ``LLM.generate``'s) set no pace.

* ``decoding_max_num_tokens``: the budget of a step while some running sequence decodes. A decoding request
  waits through every step until its next token, so its TPOT is the length of the steps it rides in; prefill
  chunks beside it are capped to keep them short. A step with no decode gives its first prefill up to
  ``max_num_tokens``, and the prompts after it only what keeps the step within this budget: a prompt whose
  first token would otherwise wait for every prompt packed behind it into one long step gets it after its
  own prefill (a first token ends a request's TTFT; the step that computes it ends for all its prompts at once).
* ``short_prompt_lead_s``: "arrival" in the order above is ``arrival + lead x prompt / max_input_len``: a prompt
  of the engine's longest input lets shorter ones that arrived up to ``lead`` seconds after it go first. Short
  requests then see their first token after their own short prefill, not after every long one queued before
  them (shortest-first minimises the mean wait), and no long prompt waits more than ``lead`` for later ones.

Chunks of a long prompt end on block boundaries, except the last one.

Batch work (priority ``BATCH_PRIORITY``, the lowest) shares steps with online work by two shares of the token
budget. While online requests are running or waiting, batch work runs on a credit of ``batch_min_share`` of
the budget per step: online work never takes it (the floor: batch always progresses), batch never spends more
(the ceiling that keeps online steps short: on a compute-bound device a step's time grows with its tokens).
Unspent credit carries over up to one KV block, so that a batch prefill chunk, which must be block-aligned,
still fits a share smaller than a block. With no online request in the runtime, batch work takes up to
``batch_max_share`` of each step (a bound on the step an arriving online request waits for). Both ways its
decodes beyond the share wait a step, and batch requests beyond the floor's reach in the queue wait for it.

Capacity policies:

* ``guaranteed_no_evict``: a request is admitted only if the pool can hold its prompt + max_tokens on top
  of what every running request may still need, so a running request never runs out of blocks.
  Priorities order admission only.
* ``max_utilization``: admit whenever the next chunk fits. When a running request needs a block and none is
  free, preempt the lowest-priority, latest-arrived running request not yet scheduled in this step (possibly
  itself). When the next waiting request cannot be admitted (no block or no seat), preempt running requests
  of lower priority than it, lowest priority and latest arrival first, until it fits; running requests of
  lower priority than it are served after it in the step, so they are still preemptable. A preempted
  request's blocks are freed and it waits to be recomputed (its prefix may still be cached).

LoRA adapters (an engine that takes them): a request of an adapter holds a slot of the adapter pool while it
runs (acquired at admission, released when it is preempted or ends). A waiting request whose adapter finds
no slot (every slot holds an adapter some running request uses) waits at the head of the queue, as it does
for blocks; the pool's LRU swap happens at admission, between steps, never under a running request.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kiln.contract import NO_ADAPTER, InvalidRequestError
from kiln.runtime.adapters import AdapterPool
from kiln.runtime.kv_cache import KVCacheManager, cdiv
from kiln.runtime.outputs import BATCH_PRIORITY, REQUEST_CLASSES, request_class
from kiln.runtime.request import Request, RequestStatus

logger = logging.getLogger("kiln.runtime")

CAPACITY_POLICIES = ("guaranteed_no_evict", "max_utilization")


def least_decoding_budget(max_batch_size: int, tokens_per_block: int) -> int:
    """The smallest ``decoding_max_num_tokens``: a step full of decodes (all but one sequence decoding) still has
    room for a block of the last one's prefill."""
    return max_batch_size - 1 + tokens_per_block


@dataclass
class SchedulerConfig:
    """Per-step budgets and sequence bounds, already checked against the engine (ExecutorConfig)."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    max_input_len: int
    capacity_policy: str = "guaranteed_no_evict"
    batch_max_share: float = 1 / 16     # most of a step's token budget batch requests take with no online work
    batch_min_share: float = 1 / 128    # their credit per step (floor and ceiling) while online work is present
    max_num_logits: int | None = None   # logits rows per step (the engine's bound; speculation's proposals take rows)
    decoding_max_num_tokens: int | None = None   # the step budget while a sequence decodes (None: max_num_tokens)
    short_prompt_lead_s: float = 0.0    # seconds of queue place a longest prompt yields to shorter ones
    tpot_target_s: float = 0.0          # the pace decoding streams are held to, s a token (0: not paced)
    step_time: tuple[float, float] | None = None   # the engine's step time a + b x tokens (s, s/token), when fitted


@dataclass
class ScheduledRequest:
    request: Request
    start: int              # num_computed_tokens before this step (position of the first new token)
    num_new_tokens: int     # including num_spec proposals
    num_spec: int = 0       # proposals (the request's spec_token_ids[:num_spec]) after its last token

    @property
    def samples(self) -> bool:
        """Does this step reach the request's last token (so its logits give the next token)?"""
        return self.start + self.num_new_tokens - self.num_spec == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)   # context chunks first, then decodes
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0    # including the proposals verified
    num_spec_tokens: int = 0      # proposals in this step (0: a step exactly as without speculation)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class _Step:
    """What is left of one step's budget while it is being filled."""

    tokens: int
    budget: int
    seats: int
    out: SchedulerOutput
    batch_tokens: int = 0          # what is left of the batch class's share
    batch_reserve: int = 0         # what is left of the batch class's floor (online work may not take it)
    batch_used: int = 0            # tokens batch requests took
    online_present: bool = False   # online requests are running or waiting (batch runs on its credit)
    logits: int = 0                # logits rows left (each scheduled sequence takes at most 1 + its proposals)
    scheduled: set[str] = field(default_factory=set)   # request ids given tokens in this step
    now: float = 0.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, adapters: AdapterPool | None = None):
        self.config = config
        self.kv = kv
        self.adapters = adapters   # the adapter pool's slots (an engine that takes LoRA adapters), or None
        self.block_size = kv.block_size
        self.waiting: list[Request] = []     # sorted by order_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}   # every unfinished request
        self.num_preemptions = 0
        self.batch_credit = 0.0    # tokens batch work may still spend (while online work is present)
        # requests per queue and class ("running_online", "waiting_batch", ...), kept by _join and _leave where
        # requests enter and leave the queues, so that each step's batch share is O(1)
        self._counts = {f"{state}_{cls}": 0 for state in ("running", "waiting") for cls in REQUEST_CLASSES}

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
        """Blocks a request's table spans at its longest (the last generated token is never fed back)."""
        return cdiv(num_prompt_tokens + max_tokens - 1, self.block_size)

    # ---- queues -----------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        lead = self.config.short_prompt_lead_s
        if lead:
            request.rank_time = request.arrival_time + lead * request.num_prompt_tokens / self.config.max_input_len
        self._enqueue(request)

    def add_imported(self, request: Request) -> None:
        """A request whose prompt KV is already in its blocks (another executor prefilled it: the executor's KV
        import): it runs from now on, as if admitted and prefilled here."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._join("running", request)

    def _enqueue(self, request: Request) -> None:
        keys = [r.order_key for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.order_key), request)
        self._join("waiting", request)

    def _join(self, queue: str, request: Request) -> None:
        self._counts[f"{queue}_{request_class(request.priority)}"] += 1

    def _leave(self, queue: str, request: Request) -> None:
        """Take ``request`` out of ``queue`` ("running" or "waiting") and out of its class count."""
        getattr(self, queue).remove(request)
        self._counts[f"{queue}_{request_class(request.priority)}"] -= 1

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def unfinished_ids(self) -> list[str]:
        return list(self.requests)

    def class_counts(self) -> dict[str, int]:
        """Running and waiting requests per class ("running_online", "waiting_batch", ...)."""
        return dict(self._counts)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus,
                        stop_reason: str | int | None = None) -> list[Request]:
        """End requests in any state (aborts, stops): free their blocks, set their status, stop reason and
        finish time, forget them. Ids that are unknown or already finished are skipped; returns the ended."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        now = time.monotonic()
        ended = []
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self._leave("running" if req.status is RequestStatus.RUNNING else "waiting", req)
            self.kv.free(req)
            self._release_adapter(req)
            req.status = status
            req.stop_reason = stop_reason
            req.metrics.finished_time = now
            ended.append(req)
        return ended

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._leave("running", request)
        self.kv.free(request)
        self._release_adapter(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        self._enqueue(request)
        logger.debug("preempted %s", request.request_id)

    def _release_adapter(self, request: Request) -> None:
        if request.lora_slot != NO_ADAPTER:
            self.adapters.release(request.lora_slot)
            request.lora_slot = NO_ADAPTER

    def _adapter_fits(self, request: Request) -> bool:
        return request.adapter is None or self.adapters.can_acquire(request.adapter)

    def reserved_blocks(self) -> int:
        """Blocks running requests may still claim (guaranteed_no_evict's promise to them)."""
        return sum(max(0, self.blocks_for_request(r.num_prompt_tokens, r.max_tokens)
                       - len(self.kv.block_table(r.request_id))) for r in self.running)

    def _chunk(self, start: int, num_tokens: int, budget: int) -> int:
        remaining = num_tokens - start
        if remaining <= budget:
            return remaining
        end = (start + budget) // self.block_size * self.block_size
        return max(0, end - start)

    # ---- one step -------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        c = self.config
        now = time.monotonic()
        budget = c.max_num_tokens
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        if decoding:
            if c.decoding_max_num_tokens is not None:
                budget = min(budget, c.decoding_max_num_tokens)
            budget = min(budget, self._paced_budget(decoding, now))
        step = _Step(budget, budget, c.max_batch_size, SchedulerOutput(), now=now,
                     logits=c.max_num_logits or c.max_num_tokens)
        self._batch_allowance(step)
        first, later = self.running, []
        if c.capacity_policy == "max_utilization" and self.waiting:
            head = self.waiting[0].priority   # lower-priority running requests come after the waiting head
            first = [r for r in self.running if r.priority >= head]
            later = [r for r in self.running if r.priority < head]
        self._schedule_running([r for r in first if r.num_tokens - r.num_computed_tokens == 1], step)
        self._schedule_prefills([r for r in first if r.num_tokens - r.num_computed_tokens > 1], step)
        self._schedule_running(later, step)
        if step.batch_reserve > 0:
            self._admit_waiting(step, floor_only=True)
        if step.online_present:
            self.batch_credit -= step.batch_used

        out = step.out
        out.scheduled.sort(key=lambda s: s.num_new_tokens == 1)  # context chunks first (stable)
        for s in out.scheduled:
            if s.num_spec:
                out.num_decode_tokens += s.num_new_tokens
                out.num_spec_tokens += s.num_spec
            elif s.num_new_tokens == 1 and s.samples and s.request.num_output_tokens > 0:
                out.num_decode_tokens += 1
            else:
                out.num_prefill_tokens += s.num_new_tokens
        return out

    def _paced_budget(self, decoding: list[Request], now: float) -> int:
        """The most tokens a step carrying ``decoding`` may take so that every online one of them still averages
        ``tpot_target_s`` a token when it ends (see the module docstring); at least the decodes and a block. Only
        ``Request.paced`` requests set it (not batch work nor ``LLM.generate``'s: no reader waits on each token)."""
        c = self.config
        if not c.tpot_target_s or c.step_time is None:
            return c.max_num_tokens
        banks = [c.tpot_target_s * r.num_output_tokens - (now - r.metrics.first_token_time) for r in decoding
                 if r.paced and r.metrics.first_token_time is not None and r.num_output_tokens]
        if not banks:
            return c.max_num_tokens
        fixed_s, per_token_s = c.step_time
        fits = int((min(banks) - fixed_s) / per_token_s) if min(banks) > fixed_s else 0
        return max(fits, len(decoding) + self.block_size)

    def _schedule_running(self, requests: list[Request], step: _Step) -> None:
        order = sorted(requests, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.order_key))
        for req in order:
            if req.status is not RequestStatus.RUNNING or req.request_id in step.scheduled:
                continue  # preempted, or preempted and admitted again, earlier in this step
            if step.tokens <= 0 or step.seats <= 0:
                break
            budget = self._budget(req, step)
            n = self._chunk(req.num_computed_tokens, req.num_tokens, budget)
            if n == 0:
                continue
            spec = 0
            # a decode with proposals: 1 + k tokens, when the budget, the logits rows and the pool allow
            if req.spec_token_ids and n == 1:
                # every sequence that may still join this step keeps a logits row
                pending = min(step.seats, len(self.running) + len(self.waiting) - len(step.scheduled))
                spec = max(0, min(len(req.spec_token_ids), budget - n, step.logits - pending))
                if spec and not self.kv.allocate_slots(req, n + spec):
                    spec = 0
                del req.spec_token_ids[spec:]
                if spec:
                    self._take(req, req.num_computed_tokens, n + spec, step, spec)
                    continue
            while not self.kv.allocate_slots(req, n):
                if self.config.capacity_policy != "max_utilization":
                    logger.warning("guaranteed_no_evict: %s found no free block; it waits a step", req.request_id)
                    break
                victim = max((r for r in self.running if r.request_id not in step.scheduled), key=lambda r: r.order_key)
                self._preempt(victim, step.out)
                if victim is req:
                    break
            else:
                self._take(req, req.num_computed_tokens, n, step)

    def _schedule_prefills(self, requests: list[Request], step: _Step) -> None:
        """Running prefills and waiting requests in one order (``order_key``): a waiting request that ranks
        before a running request's unfinished prefill (a short prompt within its lead, a higher priority) takes
        the budget first instead of waiting for that prompt's last chunk. The queue head still blocks the rest
        of the queue, and a step that preempted admits no one."""
        pending = sorted(requests, key=lambda r: r.order_key)
        admit, by_admission = True, 0   # a step that preempted for a running request admits no one
        # a step without decodes gives its first prefill the whole budget, and the prompts after it only what
        # keeps the step within decoding_max_num_tokens: each first token then waits for its own prefill (and the
        # few tokens amortizing the step), not for the prompts packed behind it into one long step
        c = self.config
        fill = c.decoding_max_num_tokens if c.decoding_max_num_tokens and step.budget > c.decoding_max_num_tokens \
            else None
        while step.tokens > 0 and step.seats > 0:
            head = self.waiting[0] if admit and len(step.out.preempted) == by_admission and self.waiting else None
            before = (len(step.out.scheduled), len(step.out.preempted))
            if head is not None and (not pending or head.order_key < pending[0].order_key):
                admit = self._admit_waiting(step, limit=1) == 1
                by_admission += len(step.out.preempted) - before[1]
            elif pending:
                self._schedule_running([pending.pop(0)], step)
            else:
                return
            if fill is not None and len(step.out.scheduled) > before[0]:
                used = step.budget - step.tokens
                step.tokens = min(step.tokens, max(step.batch_reserve, fill - used))   # the batch floor stays
                fill = None

    def _admit_waiting(self, step: _Step, floor_only: bool = False, limit: int | None = None) -> int:
        """Admit from the head of the queue (at most ``limit`` requests); ``floor_only``: admit batch requests
        past a blocked online head, within what is left of the batch floor (the one exception to "no
        overtaking"). Returns how many were admitted."""
        c, kv, bs = self.config, self.kv, self.block_size
        admitted = 0
        while self.waiting and step.tokens > 0 and (limit is None or admitted < limit):
            req = self.waiting[0]
            budget = self._budget(req, step)
            if floor_only:
                req = next((r for r in self.waiting if r.priority <= BATCH_PRIORITY), None)
                if req is None or step.batch_reserve <= 0:
                    break
                budget = min(self._budget(req, step), step.batch_reserve)
            if req.status is RequestStatus.PREEMPTED and req in step.out.preempted:
                break  # it made room in this step; it comes back in a later one
            hits = kv.get_computed_blocks(req)
            start = len(hits) * bs
            n = self._chunk(start, req.num_tokens, budget)
            if n == 0:
                break  # no budget left for a block-aligned chunk: preempting would not help
            keep_free = 0
            if c.capacity_policy == "guaranteed_no_evict":
                # the pool must also hold the rest of this request and what running requests may claim
                rest = self.blocks_for_request(req.num_prompt_tokens, req.max_tokens) - cdiv(start + n, bs)
                keep_free = self.reserved_blocks() + rest
            if not self._adapter_fits(req):
                break   # every adapter slot is in use by running requests: it waits for one to end
            if not (len(self.running) < c.max_batch_size and kv.allocate_slots(req, n, hits, keep_free)):
                victims = [r for r in self.running if r.priority < req.priority and r.request_id not in step.scheduled]
                if c.capacity_policy != "max_utilization" or not victims:
                    break
                self._preempt(max(victims, key=lambda r: r.order_key), step.out)
                continue
            self._leave("waiting", req)
            if req.adapter is not None:
                req.lora_slot = self.adapters.acquire(req.adapter)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = start
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = step.now
                req.metrics.num_cached_tokens = start
            self.running.append(req)
            self._join("running", req)
            self._take(req, start, n, step)
            admitted += 1
        return admitted

    def _batch_allowance(self, step: _Step) -> None:
        """Set this step's batch share (``batch_tokens``) and floor (``batch_reserve``), see the module docstring."""
        c, n = self.config, self._counts
        if not n["running_batch"] + n["waiting_batch"]:
            self.batch_credit = 0.0
            return
        step.online_present = n["running_online"] + n["waiting_online"] > 0
        if not step.online_present:
            self.batch_credit = 0.0
            # at least one block: a smaller prefill chunk could not be block-aligned
            step.batch_tokens = min(c.max_num_tokens, max(self.block_size, int(c.batch_max_share * c.max_num_tokens)))
            return
        per_step = c.batch_min_share * c.max_num_tokens
        self.batch_credit = min(self.batch_credit + per_step, max(per_step, self.block_size))
        step.batch_tokens = step.batch_reserve = min(int(self.batch_credit), c.max_num_tokens)

    def _budget(self, req: Request, step: _Step) -> int:
        """Tokens ``req`` may take in this step: batch-class requests only from their share, online ones not
        from what is left of the batch floor."""
        if req.priority <= BATCH_PRIORITY:
            return min(step.tokens, step.batch_tokens)
        return max(0, step.tokens - step.batch_reserve)

    def _take(self, req: Request, start: int, n: int, step: _Step, spec: int = 0) -> None:
        step.out.scheduled.append(ScheduledRequest(req, start, n, spec))
        step.scheduled.add(req.request_id)
        step.tokens -= n
        step.logits -= 1 + spec
        if req.priority <= BATCH_PRIORITY:
            step.batch_tokens -= n
            step.batch_reserve = max(0, step.batch_reserve - n)
            step.batch_used += n
        step.seats -= 1

    # ---- after the forward ----------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[int, int],
                           accepted: dict[int, list[int]] | None = None) -> list[tuple[Request, int]]:
        """Advance the scheduled requests' progress and append the sampled tokens (``sampled``: index in
        ``out.scheduled`` -> token id; ``accepted``: index -> the proposals verified, which come before the
        sampled token; the rejected ones are rolled back: their KV slots are dropped, and a block left empty is
        freed). Returns (request, token) for each new token, a request's in order; the stop rules
        (``stopping``) decide which of them end, through :meth:`drop_output_tokens` and :meth:`finish_requests`."""
        new = []
        for i, s in enumerate(out.scheduled):
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue
            if s.num_spec:
                good = accepted[i]
                req.num_computed_tokens += s.num_new_tokens - s.num_spec + len(good)
                req.spec_token_ids = []
                if len(good) < s.num_spec:
                    self.kv.trim(req)
                for token in good:
                    req.append_token(token)
                    new.append((req, token))
            else:
                req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req)
            token = sampled.get(i)
            if token is not None:
                req.append_token(token)
                new.append((req, token))
        return new

    def drop_output_tokens(self, req: Request, n: int) -> None:
        """Take the last ``n`` generated tokens back (speculation emitted them past a stop: they were never
        generated as far as the request's output goes); the request ends next, so its KV is not touched."""
        if n:
            del req.output_token_ids[-n:]
            del req.all_token_ids[-n:]
