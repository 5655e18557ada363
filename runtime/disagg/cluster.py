"""The disaggregated frontend: ``DisaggLLM`` is an ``LLM`` whose requests run on prefill and decode workers.

    llm = DisaggLLM("engines/llama", prefill_workers=1, decode_workers=1, max_batch_size=16)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64))   # as LLM; kiln serve uses it the same way

Each worker is a process with its own LLM (``kiln.runtime.disagg.worker``), started here on this machine or, with
``listen="HOST:PORT"``, started anywhere with ``kiln worker --connect HOST:PORT`` (``pool``: membership). A
request goes to the prefill worker that holds the longest cached prefix of its prompt unless its queue makes
another sooner (``router``: least loaded when none holds one); it computes the prompt's KV and the first token
and exports the blocks (``kiln.runtime.kv_transfer``). This frontend then picks the decode worker with the
fewest requests, which reserves the blocks (its admission counts them), receives them over torch.distributed
(``transport``), and continues the sequence; every output the caller sees comes from the decode worker (the first
token included, once its blocks landed, so TTFT covers the transfer).

Failure: a worker that dies (its connection closes, or it goes silent) fails its requests in flight at once with
an error naming it, routing skips it, and ``failure`` (health checks) stays None while one worker of each role
lives (``health()`` names the degraded pool). A worker that connects again in the same role takes the dead one's
slot back (health returns to ok, routing uses it). A transfer that fails or times out fails its request only.

Not carried yet: LoRA adapters and structured output (``kv_transfer.untransferable``: refused with a clear error).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.contract import (
    ConfigError,
    EngineConfig,
    ExecutorClosedError,
    InvalidRequestError,
    read_engine_config,
)
from kiln.runtime.detokenizer import load_tokenizer
from kiln.runtime.disagg.pool import PoolWorker, WorkerPool, worker_options
from kiln.runtime.disagg.router import PrefixRouter
from kiln.runtime.executor import Executor, ExecutorConfig
from kiln.runtime.kv_cache import KVCacheManager
from kiln.runtime.kv_transfer import untransferable
from kiln.runtime.llm import LLM
from kiln.runtime.metrics import Histogram, RuntimeMetrics
from kiln.runtime.outputs import RequestMetrics, RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger("kiln.runtime")

# engine-side counters: summed over the workers (the request-level ones are counted here, once per request)
WORKER_COUNTERS = ("steps", "preemptions", "prefill_tokens_computed", "decode_tokens_computed", "generation_tokens",
                   "engine_time", "step_time")
DISAGG_HISTOGRAMS = ("ttft_prefill", "ttft_transfer", "kv_transfer_time")


@dataclass(frozen=True)
class EngineInfo:
    """What the frontend knows of the engine (its config; the workers load the graph)."""

    config: EngineConfig
    directory: Path

    @property
    def failure(self) -> str | None:
        return None

    def close(self) -> None:
        pass


@dataclass
class _Flight:
    """A request in flight: where it is (the uids of its prefill and decode workers) and what the caller saw last."""

    request_id: str
    ids: list[int]
    params: SamplingParams
    priority: int
    arrival: float
    prompt: str | None
    callback: Callable[[RequestOutput], None] | None
    prefill: int
    decode: int | None = None
    aborted: bool = False
    prefilled_at: float | None = None
    last: RequestOutput | None = None
    paced: bool = True   # its decode keeps the pace (Executor.submit's paced)


class ClusterExecutor:
    """The executor interface (submit, abort, validate, stats, failure, close) over the workers.

    ``listen``: None starts ``prefill_workers`` + ``decode_workers`` local workers; "HOST:PORT" starts none and
    waits for that many to connect (``kiln worker``), taking more (and restarted ones) as they come.
    ``kv_store_port``: the TCPStore the KV pairs meet on (0: a free one; workers learn it when they join)."""

    def __init__(self, directory: Path, config: EngineConfig, tokenizer, options: ExecutorConfig,
                 prefill_workers: int, decode_workers: int, worker_threads: int | None = None,
                 transfer_timeout: float = 30.0, log_level: str = "warning", listen: str | None = None,
                 kv_store_port: int = 0):
        if prefill_workers < 1 or decode_workers < 1:
            raise ConfigError(f"disaggregated serving needs at least one prefill and one decode worker, got "
                              f"{prefill_workers} and {decode_workers}")
        if config.tp_size > 1:
            raise ConfigError("disaggregated serving runs single-rank engines (this one has tp_size "
                              f"{config.tp_size})")
        if not transfer_timeout > 0:
            raise ConfigError(f"transfer_timeout must be > 0 seconds, got {transfer_timeout!r}")
        self.tokenizer = tokenizer
        self.vocab_size = config.model.vocab_size
        self.eos_token_ids = tuple(config.tokenizer.eos_token_ids)
        self.adapters = None
        self.config = options
        self.metrics = RuntimeMetrics(options.metrics_window)
        for name in DISAGG_HISTOGRAMS:
            self.metrics.hist[name] = Histogram()
        self.transfer = {"transfers": 0, "blocks": 0, "bytes": 0, "seconds": 0.0, "failed": 0}
        self.block_size = config.bounds.tokens_per_block
        self.router = PrefixRouter(self.block_size, options.enable_prefix_reuse)
        # requests sent to a prefill worker for a cached prefix of theirs, and the prompt tokens expected cached
        self.routing = {"prefix_routed": 0, "prefix_routed_tokens": 0}
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}
        # request-seconds per role (the time integral of the requests in flight there; mean queue = its rate)
        self.request_seconds = {"prefill": 0.0, "decode": 0.0}
        self._area_t = time.monotonic()
        self._ids = itertools.count()
        self._tags = itertools.count(1)
        self._closed = False
        n_local = 0 if listen else prefill_workers + decode_workers
        threads = worker_threads or (max(1, (os.cpu_count() or 1) // n_local) if n_local else None)
        init = {"options": worker_options(options, n_local), "threads": threads,
                "transfer_timeout": transfer_timeout, "log_level": log_level}
        self.pool = WorkerPool(directory, lambda role: init, self._on_message, self._on_join, self._on_death, listen,
                               kv_store_port)
        try:
            for role, count in (("prefill", prefill_workers), ("decode", decode_workers)):
                for _ in range(count if n_local else 0):
                    self.pool.spawn(role, threads)
            self.pool.wait_for({"prefill": prefill_workers, "decode": decode_workers})
        except BaseException:
            self.pool.kill()
            raise
        decode = self.pool.alive("decode")
        b = config.bounds
        smallest = min(w.info["num_blocks"] for w in self.pool.workers())
        # the request checks of one worker (every worker at start holds at least this many blocks)
        self.scheduler = Scheduler(SchedulerConfig(min(w.info["max_batch_size"] for w in decode), b.max_num_tokens,
                                                   b.max_seq_len, b.max_input_len),
                                   KVCacheManager(smallest, self.block_size, False))
        self.bytes_per_block = decode[0].info["bytes_per_block"]

    @property
    def workers(self) -> list[PoolWorker]:
        return self.pool.workers()

    @property
    def kv_plan(self) -> str:
        return "; ".join(f"{w.name}: {w.info['kv_plan']}" for w in self.pool.workers())

    @property
    def max_batch_size(self) -> int:
        return sum(w.info["max_batch_size"] for w in self.pool.alive("decode"))

    # ---- membership (the pool's reader and admission threads) -------------------------------------------
    def _on_message(self, w: PoolWorker, msg: tuple) -> None:
        getattr(self, f"_on_{msg[0]}")(w, *msg[1:])

    def _on_join(self, w: PoolWorker) -> None:
        for peer in self.pool.alive("decode" if w.role == "prefill" else "prefill"):   # build their KV pairs now
            peer.send("peer", w.uid)
            w.send("peer", peer.uid)

    def _on_death(self, w: PoolWorker, death: str) -> None:
        if w.role == "prefill":
            self.router.forget(w.uid)
        with self._lock:
            lost = [f for f in self._flights.values()
                    if (f.decode == w.uid if w.role == "decode" else f.prefill == w.uid and f.decode is None)]
        for f in lost:
            self._fail(f, f"the {death} with this request in flight; retry it")
        for peer in self.pool.alive("decode" if w.role == "prefill" else "prefill"):
            peer.send("forget", w.uid)   # its KV pair with the dead one ends (a rejoined worker has a new uid)

    def _least_loaded_decode(self) -> PoolWorker | None:
        alive = self.pool.alive("decode")
        if not alive:
            return None
        with self._lock:
            load = {w.uid: sum(f.decode == w.uid for f in self._flights.values()) for w in alive}
        return min(alive, key=lambda w: (load[w.uid], w.index))

    def _route_prefill(self, request_id: str, ids: list[int]) -> PoolWorker | None:
        """(under ``_lock``) the prefill worker for a prompt (``router``), its request counted there."""
        alive = self.pool.alive("prefill")
        if not alive:
            return None
        load = {w.uid: sum(f.prefill == w.uid and f.decode is None for f in self._flights.values()) for w in alive}
        route = self.router.route(request_id, ids, [(w.uid, load[w.uid]) for w in alive])
        if route.cached_tokens:
            self.routing["prefix_routed"] += 1
            self.routing["prefix_routed_tokens"] += route.cached_tokens
        return next(w for w in alive if w.uid == route.uid)

    def _send(self, uid: int | None, *msg) -> None:
        w = None if uid is None else self.pool.by_uid(uid)
        if w is not None:
            w.send(*msg)

    # ---- messages from the workers (reader threads) -------------------------------------------------------
    def _on_stats(self, w: PoolWorker, stats: dict) -> None:
        w.stats = stats

    def _on_kv_events(self, w: PoolWorker, events: list) -> None:
        self.router.on_events(w.uid, events)

    def _on_prefilled(self, w: PoolWorker, rid: str, meta) -> None:
        self.router.release(rid)   # its blocks are in the worker's cache now (the events came first)
        f = self._flights.get(rid)
        if f is None or f.aborted:
            w.send("drop", rid)
            if f is not None:
                self._fail(f, None)
            return
        f.prefilled_at = time.monotonic()
        if meta.first_token_time is not None:
            self.metrics.observe("ttft_prefill", meta.first_token_time - f.arrival)
        d = self._least_loaded_decode()
        if d is None:
            w.send("drop", rid)
            self._fail(f, "no decode worker is alive")
            return
        tag = next(self._tags)
        with self._lock:
            self._advance()
            f.decode = d.uid
            self.transfer["blocks"] += meta.num_blocks
        d.send("import", rid, f.ids, f.params, f.priority, f.arrival, f.prompt, meta, w.uid, tag, f.paced)
        w.send("send", rid, d.uid, tag)

    def _on_send_failed(self, w: PoolWorker, rid: str, error: str) -> None:
        with self._lock:
            self.transfer["failed"] += 1
        f = self._flights.get(rid)
        if f is not None:
            self._send(f.decode, "abort", rid)
            self._fail(f, f"the KV transfer from prefill worker {w.index} failed: {error}")

    def _on_received(self, w: PoolWorker, rid: str, nbytes: int, seconds: float) -> None:
        """A transfer landed: counted from the receiver's report, which reaches this frontend before the request's
        outputs (one pipe, in order), so the stats after a request ends include its transfer. The time is the
        decode side's wait for the blocks, from posting the receive to holding them."""
        with self._lock:
            self.transfer["transfers"] += 1
            self.transfer["bytes"] += nbytes
            self.transfer["seconds"] += seconds
        self.metrics.observe("kv_transfer_time", seconds)

    def _on_ended(self, w: PoolWorker, rid: str, out: RequestOutput) -> None:
        f = self._flights.get(rid)
        if f is not None:   # ended in prefill: aborted, or the engine failed on it
            self._finish(f, out)

    def _on_rejected(self, w: PoolWorker, rid: str, error: str) -> None:
        f = self._flights.get(rid)
        if f is not None:
            self._fail(f, f"the {w.name} refused the request: {error}")

    def _on_out(self, w: PoolWorker, rid: str, out: RequestOutput) -> None:
        f = self._flights.get(rid)
        if f is None or f.decode != w.uid:
            return
        now = time.monotonic()
        if f.last is None:
            if f.prefilled_at is not None:
                self.metrics.observe("ttft_transfer", now - f.prefilled_at)
        if out.finished:
            self._finish(f, out)
        else:
            f.last = out
            self._deliver(f, out)

    # ---- requests ---------------------------------------------------------------------------------------
    def _deliver(self, f: _Flight, out: RequestOutput) -> None:
        if f.callback is not None:
            try:
                f.callback(out)
            except Exception:
                logger.exception("output callback of %s failed", f.request_id)

    def _finish(self, f: _Flight, out: RequestOutput) -> None:
        with self._lock:
            if f.request_id not in self._flights:
                return   # ended already (a worker died and its requests were failed)
            self._advance()
            del self._flights[f.request_id]
        self.router.release(f.request_id)
        self.metrics.record_request(out.metrics, "error" if out.error else out.finish_reason)
        self._deliver(f, out)

    def _fail(self, f: _Flight, error: str | None) -> None:
        """End a request here (a worker died, a transfer failed, or it was aborted between workers)."""
        last = f.last
        metrics = last.metrics if last is not None else RequestMetrics(arrival_time=f.arrival, priority=f.priority)
        metrics.finished_time = time.monotonic()
        self._finish(f, RequestOutput(f.request_id, f.prompt, f.ids, list(last.token_ids) if last else [],
                                      last.text if last else "", "abort", metrics, error=error))

    def validate(self, prompt: Any, params: SamplingParams | None = None, *, priority: Any = 0,
                 request_id: Any = None, callback: Any = None, arrival_time: Any = None, lora: Any = None):
        """The checks of ``Executor.validate`` for a request whose KV moves (what that refuses), against the
        smallest worker's limits."""
        try:
            return Executor._check(self, prompt, params, priority, request_id, callback, arrival_time, lora, True)
        except (InvalidRequestError, ConfigError):
            self.metrics.incr("requests_rejected")
            raise

    @staticmethod
    def _adapter(lora: Any) -> None:
        """(Executor._check's adapter lookup) none: a named adapter was refused before (kv_transfer)."""
        return None

    def grammar_compiler(self):
        """There is none here (the OpenAI server asks for it to check a constraint early): the refusal validate
        would give."""
        raise untransferable(structured_output=True)

    def submit(self, prompt_token_ids: Any, params: SamplingParams | None = None, *,
               request_id: str | None = None, priority: int = 0, prompt: str | None = None,
               callback: Callable[[RequestOutput], None] | None = None, arrival_time: float | None = None,
               lora: str | None = None, paced: bool = True) -> str:
        checked = self.validate(prompt_token_ids, params, priority=priority, request_id=request_id,
                                callback=callback, arrival_time=arrival_time, lora=lora)
        failure = self.failure
        if failure is not None:
            self.metrics.incr("requests_rejected")
            raise ExecutorClosedError(failure)
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while request_id in self._flights:
                    request_id = f"req-{next(self._ids)}"
            elif request_id in self._flights:
                self.metrics.counters["requests_rejected"] += 1
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            p = self._route_prefill(request_id, checked.token_ids)
            if p is None:
                self.metrics.counters["requests_rejected"] += 1
                raise ExecutorClosedError("no prefill worker is alive")
            params = dataclasses.replace(checked.params, max_tokens=checked.max_tokens)
            f = _Flight(request_id, checked.token_ids, params, checked.priority,
                        time.monotonic() if arrival_time is None else arrival_time, prompt, callback, p.uid,
                        paced=paced)
            self._advance()
            self._flights[request_id] = f
        self.metrics.incr("requests_submitted")
        self.metrics.incr("prompt_tokens", len(checked.token_ids))
        if not p.send("prefill", request_id, f.ids, f.params, f.priority, f.arrival, prompt):
            self._fail(f, f"the {p.name} is gone")
        return request_id

    def abort(self, request_id: str) -> None:
        f = self._flights.get(request_id)
        if f is None:
            return
        f.aborted = True
        self._send(f.prefill if f.decode is None else f.decode, "abort", request_id)

    def in_loop_thread(self) -> bool:
        return threading.current_thread() in self.pool.readers

    @property
    def failure(self) -> str | None:
        if self._closed:
            return "the executor is closed"
        for role in ("prefill", "decode"):
            if not self.pool.alive(role):
                deaths = "; ".join(w.death or "" for w in self.pool.workers() if w.role == role)
                return f"no {role} worker is alive ({deaths})"
        return None

    def health(self) -> dict:
        """Each worker slot's state; ``degraded`` while some slot's worker died (until one rejoins in its place)
        but every role still has one."""
        workers = [{"role": w.role, "index": w.index, "uid": w.uid, "pid": w.pid, "host": w.host,
                    "alive": w.death is None, **({"error": w.death} if w.death else {})} for w in self.pool.workers()]
        status = "failed" if self.failure else "degraded" if any(not w["alive"] for w in workers) else "ok"
        return {"status": status, "workers": workers}

    def _counts(self) -> dict[str, int]:
        """(under ``_lock``) the requests in flight per role."""
        decode = sum(f.decode is not None for f in self._flights.values())
        return {"prefill": len(self._flights) - decode, "decode": decode}

    def _advance(self) -> None:
        """(under ``_lock``, before the requests in flight change) add the time since the last change times the
        requests in each role to ``request_seconds``."""
        now = time.monotonic()
        for role, n in self._counts().items():
            self.request_seconds[role] += n * (now - self._area_t)
        self._area_t = now

    def queues(self) -> dict[str, int]:
        with self._lock:
            return self._counts()

    def stats(self) -> dict:
        snap = self.metrics.snapshot()
        live = [w for w in self.pool.workers() if w.death is None and w.stats is not None]
        for key in WORKER_COUNTERS:
            snap["counters"][key] = sum(w.stats["counters"][key] for w in live)
        decode = [w.stats for w in live if w.role == "decode"]
        q = self.queues()
        g = snap["gauges"]
        g["running"], g["waiting"] = q["decode"], q["prefill"]
        for key in ("kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "kv_evictions"):
            g[key] = sum(s["gauges"][key] for s in decode)
        g["kv_usage"] = g["kv_blocks_used"] / g["kv_blocks_total"] if g["kv_blocks_total"] else 0.0
        kv = {k: sum(w.stats["kv_cache"][k] for w in live)
              for k in ("num_blocks", "used_blocks", "free_blocks", "cached_blocks", "prefix_queries",
                        "prefix_hits", "evictions")}
        kv["hit_rate"] = kv["prefix_hits"] / kv["prefix_queries"] if kv["prefix_queries"] else 0.0
        kv["usage"] = kv["used_blocks"] / kv["num_blocks"] if kv["num_blocks"] else 0.0
        g["prefix_hit_rate"] = kv["hit_rate"]
        snap["kv_cache"] = {"plan": self.kv_plan, "block_size": self.block_size, **kv}
        snap["config"] = {"max_batch_size": self.max_batch_size, "max_num_tokens": self.scheduler.config.max_num_tokens,
                          "capacity_policy": self.config.capacity_policy,
                          "enable_prefix_reuse": self.config.enable_prefix_reuse, "tokens_per_block": self.block_size}
        with self._lock:
            transfer = dict(self.transfer)
            self._advance()
            request_seconds = dict(self.request_seconds)
            routing = dict(self.routing)
        snap["disagg"] = {"workers": self.health()["workers"], "queues": q, "request_seconds": request_seconds,
                          "kv_transfer": transfer, "routing": routing,
                          "bytes_per_block": self.bytes_per_block,
                          "worker_address": f"{self.pool.address[0]}:{self.pool.address[1]}"}
        return snap

    def is_idle(self) -> bool:
        return not self._flights

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._flights:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Abort what is in flight, stop the workers (killing local ones that do not stop within 10 s)."""
        if self._closed:
            return
        for f in list(self._flights.values()):
            self._fail(f, None)
        self._closed = True
        self.pool.close()


class DisaggLLM(LLM):
    """An LLM served by ``prefill_workers`` prefill and ``decode_workers`` decode processes (see the module
    docstring); every LLM method works the same. ``worker_threads``: torch threads per worker (default: the
    CPUs shared evenly among local workers). ``transfer_timeout``: seconds one KV transfer may take before only
    its request fails. ``listen``: "HOST:PORT" to wait for that many workers started elsewhere with ``kiln worker
    --connect HOST:PORT`` (the secret in KILN_WORKER_KEY) instead of starting them here."""

    def __init__(self, engine: str | Path, tokenizer=None, *, prefill_workers: int = 1, decode_workers: int = 1,
                 worker_threads: int | None = None, transfer_timeout: float = 30.0, listen: str | None = None,
                 kv_store_port: int = 0, config: ExecutorConfig | None = None, **options):
        if options.pop("lora_modules", None):
            raise ConfigError("disaggregated workers serve no LoRA adapters yet; drop lora_modules")
        if config is not None and options:
            raise ConfigError(f"give either config or its fields as keywords, not both ({sorted(options)})")
        config = config if config is not None else ExecutorConfig(**options)
        directory = Path(engine)
        self._owns_engine = False
        self.engine = EngineInfo(read_engine_config(directory), directory)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(directory)
        self.executor = ClusterExecutor(directory, self.engine.config, self.tokenizer, config, prefill_workers,
                                        decode_workers, worker_threads, transfer_timeout, listen=listen,
                                        kv_store_port=kv_store_port)
        weakref.finalize(self, self.executor.close).atexit = True

    def _adapters(self):
        raise ConfigError("disaggregated workers serve no LoRA adapters yet")

    def lora_names(self) -> list[str]:
        return []
