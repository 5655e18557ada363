"""Executor: the step loop. Scheduler + KVCacheManager + Sampler around one engine, on a background thread.

Each step: take new submissions and aborts, schedule, pack the scheduled tokens into the engine contract's
inputs, run the engine, sample, advance the requests, detokenize, check stop strings, hand outputs to the
requests' callbacks, record metrics. ``submit`` / ``abort`` / ``stats`` are safe from any thread; invalid
requests are refused in the caller's thread (``InvalidRequestError``) before anything is queued.

The engine is anything with the ``Engine`` interface (``build``, ``model``, ``eos_token_ids``,
``kv_bytes_per_token``, ``allocate_kv_cache(num_blocks)``, ``run(inputs) -> logits``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.contract import ExecutorClosedError, InvalidRequestError, SeqChunk, pack_inputs
from kiln.runtime.kv_cache import KVCacheManager, plan_num_blocks
from kiln.runtime.metrics import RuntimeMetrics, StepRecord
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import CAPACITY_POLICIES, Scheduler, SchedulerConfig, SchedulerOutput

logger = logging.getLogger("kiln.runtime")


@dataclass
class ExecutorConfig:
    """Serving options. ``None`` for a bound means the engine's own.

    max_batch_size / max_num_tokens: per-step budgets, at most the engine's build bounds.
    kv_cache_memory_fraction: share of the memory available after the engine is loaded given to the KV pool.
    max_kv_cache_tokens: absolute cap on the pool in tokens (the smaller limit wins).
    capacity_policy: "guaranteed_no_evict" or "max_utilization" (see scheduler.py).
    enable_prefix_reuse: share KV blocks of common prefixes between requests.
    seed: seed of the generator used by requests without their own seed.
    """

    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    kv_cache_memory_fraction: float | None = 0.9
    max_kv_cache_tokens: int | None = None
    capacity_policy: str = "guaranteed_no_evict"
    enable_prefix_reuse: bool = True
    seed: int | None = None
    metrics_window: int = 4096

    def __post_init__(self) -> None:
        if self.capacity_policy not in CAPACITY_POLICIES:
            raise ValueError(f"capacity_policy must be one of {CAPACITY_POLICIES}, got {self.capacity_policy!r}")


@dataclass
class _Track:
    """Executor-side state of a request's output stream."""

    callback: Callable[[RequestOutput], None] | None
    detok: IncrementalDetokenizer | None
    text: str = ""
    sent_tokens: int = 0
    sent_text: int = 0
    error: str | None = None
    stop_hold: int = 0          # characters held back while a stop string could still be completing


class Executor:
    def __init__(self, engine, config: ExecutorConfig | None = None, tokenizer=None, start: bool = True):
        self.engine = engine
        self.config = config = config or ExecutorConfig()
        self.tokenizer = tokenizer
        b = engine.config.bounds
        self.block_size = b.tokens_per_block
        self.vocab_size = engine.config.model.vocab_size
        self.eos_token_ids = tuple(engine.config.tokenizer.eos_token_ids)

        def bound(name: str, value: int | None) -> int:
            limit = getattr(b, name)
            if value is None:
                return limit
            if not 1 <= value <= limit:
                raise ValueError(f"{name}={value} is outside the engine's bound [1, {limit}] "
                                 f"(rebuild the engine to raise it)")
            return int(value)

        max_batch_size = bound("max_batch_size", config.max_batch_size)
        max_num_tokens = bound("max_num_tokens", config.max_num_tokens)
        max_seq_len, max_input_len = b.max_seq_len, b.max_input_len
        num_blocks, why = plan_num_blocks(
            engine.kv_bytes_per_token, self.block_size, memory_fraction=config.kv_cache_memory_fraction,
            max_kv_cache_tokens=config.max_kv_cache_tokens, useful_tokens=2 * max_batch_size * max_seq_len,
        )
        logger.info(why)
        self.kv_plan = why
        self.kv_cache = engine.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, self.block_size, config.enable_prefix_reuse)
        self.scheduler = Scheduler(
            SchedulerConfig(max_batch_size, max_num_tokens, max_seq_len, max_input_len, config.capacity_policy),
            self.kv)
        self.sampler = Sampler(self.vocab_size, config.seed)
        self.metrics = RuntimeMetrics(config.metrics_window)
        self.metrics.gauges["kv_blocks_total"] = num_blocks
        self._kv_stats = self.kv.stats().as_dict()

        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._aborts: list[str] = []
        self._live: set[str] = set()          # ids submitted and not yet finished (guarded by _cv)
        self._tracks: dict[str, _Track] = {}
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    # ---- public, any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kiln-step-loop", daemon=True)
            self._thread.start()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Effective max_tokens, or InvalidRequestError (nothing is queued)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; the engine directory has no tokenizer.json")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidRequestError(f"logprobs={params.logprobs} exceeds the vocabulary size {self.vocab_size}")
        return self.scheduler.resolve_max_tokens(len(prompt_token_ids), params.max_tokens)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, priority: int = 0, prompt: str | None = None,
               callback: Callable[[RequestOutput], None] | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. ``callback`` receives a RequestOutput after every step that
        changed it (from the step-loop thread; keep it short) and once more when it finishes."""
        params = params if params is not None else SamplingParams()
        try:
            prompt_token_ids = [int(t) for t in prompt_token_ids]
        except (TypeError, ValueError):
            self.metrics.incr("requests_rejected")
            raise InvalidRequestError("prompt token ids must be integers") from None
        try:
            max_tokens = self.validate(prompt_token_ids, params)
        except InvalidRequestError:
            self.metrics.incr("requests_rejected")
            raise
        with self._cv:
            if self._closed or self._error is not None:
                raise ExecutorClosedError(f"the executor is closed{': ' + repr(self._error) if self._error else ''}")
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while request_id in self._live:
                    request_id = f"req-{next(self._ids)}"
            elif request_id in self._live:
                self.metrics.incr("requests_rejected")
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            req = Request(request_id, prompt_token_ids, params, max_tokens, priority=priority,
                          arrival_time=arrival_time, seq=next(self._seq), prompt=prompt,
                          eos_token_ids=self.eos_token_ids)
            detok = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                     if self.tokenizer is not None else None)
            hold = max((len(s) for s in params.stop), default=1) - 1
            self._tracks[request_id] = _Track(callback, detok, stop_hold=hold)
            self._live.add(request_id)
            self._incoming.append(req)
            self._cv.notify()
        self.metrics.incr("requests_submitted")
        self.metrics.incr("prompt_tokens", len(prompt_token_ids))
        return request_id

    def abort(self, request_id: str) -> None:
        """Abort a queued or running request; its final output has finish_reason "abort". Unknown ids are ignored."""
        with self._cv:
            if request_id in self._live:
                self._aborts.append(request_id)
                self._cv.notify()

    def stats(self) -> dict:
        snap = self.metrics.snapshot()
        snap["kv_cache"] = {"plan": self.kv_plan, **self._kv_stats}
        snap["config"] = {
            "max_batch_size": self.scheduler.config.max_batch_size,
            "max_num_tokens": self.scheduler.config.max_num_tokens,
            "capacity_policy": self.scheduler.config.capacity_policy,
            "enable_prefix_reuse": self.kv.enable_prefix_reuse,
            "tokens_per_block": self.block_size,
        }
        return snap

    def is_idle(self) -> bool:
        with self._cv:
            return not self._live

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._live:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 0.1)
        return True

    def close(self) -> None:
        """Stop the loop; requests still queued or running end with finish_reason "abort"."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # ---- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            with self._cv:
                while not (self._incoming or self._aborts or self._closed or sched.has_unfinished()):
                    self._cv.wait()
                incoming, self._incoming = self._incoming, []
                aborts, self._aborts = self._aborts, []
                closed = self._closed
            for req in incoming:
                sched.add_request(req)
            for rid in aborts:
                req = sched.abort(rid)
                if req is not None:
                    self._finish(req)
            if closed:
                for req in list(sched.waiting) + list(sched.running):
                    sched.finish(req, RequestStatus.FINISHED_ABORTED)
                    self._finish(req)
                return
            if not sched.has_unfinished():
                continue
            try:
                self.step()
            except BaseException as exc:  # the engine failed: end everything, refuse new work
                logger.error("step loop failed: %s", traceback.format_exc())
                with self._cv:
                    self._error = exc
                for req in list(sched.waiting) + list(sched.running):
                    sched.finish(req, RequestStatus.FINISHED_ABORTED)
                    self._tracks[req.request_id].error = f"{type(exc).__name__}: {exc}"
                    self._finish(req)
                with self._cv:
                    for req in self._incoming:
                        self._tracks[req.request_id].error = f"{type(exc).__name__}: {exc}"
                        req.status = RequestStatus.FINISHED_ABORTED
                        self._finish(req)
                    self._incoming = []
                return

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Contract inputs for the scheduled tokens; also which scheduled entries produce logits."""
        chunks = [SeqChunk(s.request.all_token_ids[s.start:s.start + s.num_new_tokens], s.start,
                           s.request.block_ids, 1 if s.samples else 0) for s in out.scheduled]
        sampled = [i for i, s in enumerate(out.scheduled) if s.samples]
        return pack_inputs(chunks, self.kv_cache, self.block_size), sampled

    def step(self) -> None:
        t0 = time.perf_counter()
        sched = self.scheduler
        out = sched.schedule()
        if not out:
            time.sleep(0.001)  # nothing fits right now (cannot last: admission checks guarantee progress)
            return
        inputs, sampled_idx = self.prepare_inputs(out)
        t1 = time.perf_counter()
        logits = self.engine.run(inputs)   # num_logits may be 0: a step of non-final prefill chunks
        engine_time = time.perf_counter() - t1
        reqs = [out.scheduled[i].request for i in sampled_idx]
        sample = self.sampler(logits, reqs) if reqs else None
        sampled = {i: sample.token_ids[j] for j, i in enumerate(sampled_idx)} if sample else {}
        now = time.monotonic()
        finished = {id(r) for r in sched.update(out, sampled)}
        for j, req in enumerate(reqs):
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            else:
                self.metrics.observe("inter_token_latency", now - m.last_token_time)
            m.last_token_time = now
            m.num_generated_tokens = req.num_output_tokens
            if req.logprobs is not None:
                req.logprobs.append(sample.logprobs[j])
            track = self._tracks[req.request_id]
            if track.detok is not None:
                track.text += track.detok.step([req.output_token_ids[-1]])
                if req.params.stop and id(req) not in finished and self._check_stop_strings(req, track):
                    sched.finish(req, RequestStatus.FINISHED_STOPPED)
                    finished.add(id(req))
            if id(req) in finished:
                m.finished_time = now
                self._finish(req)
            else:
                self._emit(req, track)
        step_time = time.perf_counter() - t0
        self._kv_stats = self.kv.stats().as_dict()
        self.metrics.record_step(StepRecord(
            time=now, step_time=step_time, engine_time=engine_time, num_running=len(sched.running),
            num_waiting=len(sched.waiting), num_preempted=len(out.preempted), batch_size=len(out.scheduled),
            prefill_tokens=out.num_prefill_tokens, decode_tokens=out.num_decode_tokens, sampled_tokens=len(reqs),
            kv_usage=self.kv.usage, prefix_hit_rate=self._kv_stats["hit_rate"]), self._kv_stats)

    # ---- outputs --------------------------------------------------------------------------------------
    def _check_stop_strings(self, req: Request, track: _Track) -> bool:
        text = track.text
        longest = max(len(s) for s in req.params.stop)
        lo = max(0, track.sent_text - longest)
        best = None
        for s in req.params.stop:
            k = text.find(s, lo)
            if k >= 0 and (best is None or k < best[0]):
                best = (k, s)
        if best is None:
            return False
        k, s = best
        track.text = text[:k + len(s)] if req.params.include_stop_str_in_output else text[:k]
        req.stop_reason = s
        return True

    def _snapshot(self, req: Request, track: _Track, final: bool) -> RequestOutput:
        text_end = len(track.text) if final else max(track.sent_text, len(track.text) - track.stop_hold)
        out = RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=track.text[:text_end],
            finish_reason=req.status.value if final else None, metrics=req.metrics,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            delta_token_ids=req.output_token_ids[track.sent_tokens:],
            delta_text=track.text[track.sent_text:text_end], stop_reason=req.stop_reason, error=track.error,
        )
        track.sent_tokens = req.num_output_tokens
        track.sent_text = text_end
        return out

    def _emit(self, req: Request, track: _Track) -> None:
        if track.callback is not None:
            try:
                track.callback(self._snapshot(req, track, final=False))
            except Exception:
                logger.exception("output callback of %s failed", req.request_id)

    def _finish(self, req: Request) -> None:
        track = self._tracks.pop(req.request_id)
        if track.detok is not None and not isinstance(req.stop_reason, str):
            track.text += track.detok.flush()
            if req.params.stop and req.status is not RequestStatus.FINISHED_ABORTED and self._check_stop_strings(req, track):
                req.status = RequestStatus.FINISHED_STOPPED
        if req.metrics.finished_time is None:
            req.metrics.finished_time = time.monotonic()
        self.metrics.record_request(req.metrics, aborted=req.status is RequestStatus.FINISHED_ABORTED)
        out = self._snapshot(req, track, final=True)
        with self._cv:
            self._live.discard(req.request_id)
            self._cv.notify_all()
        if track.callback is not None:
            try:
                track.callback(out)
            except Exception:
                logger.exception("output callback of %s failed", req.request_id)
