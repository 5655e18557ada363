"""Executor: the step loop. Scheduler + KVCacheManager + Sampler around one engine, on a background thread.

Each step (:meth:`Executor.step`): the scheduler picks the tokens, the contract's packer turns them into
the engine's inputs, the engine runs, the sampler picks next tokens, the scheduler advances the requests,
the stop rules end some of them (through the scheduler), and each changed request's output goes to its
callback. ``submit`` / ``abort`` / ``stats`` are safe from any thread.

No request can break the loop: every field of a request is checked in the caller's thread
(``InvalidRequestError`` / ``ConfigError``, counted as rejected) before anything is queued.

Structured output (``SamplingParams.structured_output``): the constraint is parsed at submission (an invalid
one is an ``InvalidRequestError``) and compiled in ``kiln.runtime.grammar``'s thread pool; until its grammar
is ready the request waits here, outside the scheduler, while the others step. It then gets its matcher
(``Request.grammar``) and joins the scheduler's queue in arrival order. The sampler masks its logits; each
token it generates advances its matcher as the token is emitted.

Failures (the loop never dies silently, and a caller never waits on a loop that is gone):

* The engine (or the packing/sampling around it) raises on a step: only the requests of that step end,
  with ``finish_reason`` "abort" and ``error`` saying why; their blocks are freed and the loop serves on.
  The KV pool can be trusted after that: a step writes only into the not-yet-full blocks of its own
  requests (full blocks, the only ones shared or offered to the prefix cache, are never written again),
  and a step's blocks are offered to the prefix cache only after it succeeded, so the half-written
  blocks go back to the free pool unregistered. The scheduler has not advanced any of them yet.
* The engine fails ``MAX_STEP_FAILURES`` steps in a row (it is broken, not one input), or raises
  ``EngineDeadError`` (a tensor-parallel rank is gone: no step can run again), or the loop's own
  bookkeeping raises (the scheduler's or the KV manager's books are then in doubt): the executor stops.
  Every request in flight ends with the error, ``failure`` says why (for health checks), and ``submit``
  raises ``ExecutorClosedError`` naming it.
* Interpreter exit: an ``atexit`` hook closes every executor still running (aborting its requests and
  joining its thread) before modules are torn down; a daemon thread left running native kernels into the
  teardown would crash the interpreter. An executor whose ``LLM`` is garbage-collected is closed too.

The engine is anything with the ``Engine`` interface (``config`` an EngineConfig, ``kv_bytes_per_token``,
``allocate_kv_cache(num_blocks)``, ``run(inputs) -> logits``; ``allocate_lora_pool(max_loras)`` when its
config has a ``lora`` layout: then the executor owns the adapter pool (``kiln.runtime.adapters``) and passes
it with each token's slot to every step, and a request may name a loaded adapter).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import numbers
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kiln.contract import (
    ConfigError,
    EngineBounds,
    EngineDeadError,
    ExecutorClosedError,
    InvalidRequestError,
    SeqChunk,
    pack_inputs,
    reject_unknown_options,
)
from kiln.plugins.openmp_teams import TeamWatch
from kiln.runtime.adapters import AdapterPool, AdapterRegistry, LoraAdapter
from kiln.runtime.fields import SEED_RANGE, FieldChecks, is_integer
from kiln.runtime.grammar import GrammarCompiler
from kiln.runtime.kv_cache import KVCacheManager, available_memory_bytes, cdiv, plan_num_blocks
from kiln.runtime.kv_transfer import ImportMeta, KVExport, untransferable
from kiln.runtime.metrics import RuntimeMetrics, StepRecord
from kiln.runtime.output_stream import OutputStream
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.prompts import prompt_token_ids as checked_token_ids
from kiln.runtime.rejection import verify_drafted
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sampler import Sampler, SamplerOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import (
    CAPACITY_POLICIES,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    least_decoding_budget,
)
from kiln.runtime.speculative import NgramProposer, Position, Proposer, SpeculativeConfig
from kiln.runtime.step_time import StepTimeKnobs
from kiln.runtime.stopping import stop_by_token

logger = logging.getLogger("kiln.runtime")

MAX_STEP_FAILURES = 3      # consecutive failed engine steps after which the engine is taken to be broken
EXIT_JOIN_TIMEOUT_S = 60.0  # how long interpreter exit waits for a step in progress to end

_RUNNING: weakref.WeakSet[Executor] = weakref.WeakSet()   # executors whose loop thread may be running


@atexit.register
def _close_at_exit() -> None:
    """Stop every step loop still running before the interpreter tears its modules down (see the module
    docstring); their requests end as "abort"."""
    for executor in list(_RUNNING):
        executor.close(timeout=EXIT_JOIN_TIMEOUT_S)


@reject_unknown_options()
@dataclass
class ExecutorConfig:
    """Serving options (``LLM(engine, **options)``); each field's help says what it does."""

    max_batch_size: int | None = field(default=None, metadata={
        "help": "Most sequences per step; at most the engine's bound (default: the engine's)."})
    max_num_tokens: int | None = field(default=None, metadata={
        "help": "Most tokens per step; at most the engine's bound (default: the engine's)."})
    decoding_max_num_tokens: int | None = field(default=None, metadata={
        "help": "Most tokens per step while some sequence decodes (default: max_num_tokens): prefill chunks beside "
                "decodes are capped so that the steps a decoding request waits through (its TPOT) stay short; a "
                "step with no decode still takes max_num_tokens. At least max_batch_size - 1 + one KV block."})
    short_prompt_lead_s: float | None = field(default=None, metadata={
        "help": "Seconds of queue place a prompt of the engine's max_input_len gives up to shorter ones (linear "
                "in its length): short prompts arriving up to that long after a long one go first, so their first "
                "token waits for their own prefill, not every long one ahead (0: first come, first served; default: "
                "the longest prompt's own prefill time, b x max_input_len of the step time fitted as it serves)."})
    tpot_target_s: float = field(default=0.1, metadata={
        "help": "The pace every decoding stream is held to, in seconds a token (0: not paced). A step beside "
                "decodes takes only the prefill tokens that keep each stream within it on average (this engine's "
                "step time, fitted as it serves, converts seconds to tokens): a stream ahead of the pace lends its "
                "lead to a prompt's prefill (light load: a prompt is prefilled at once), one at the pace gets steps "
                "no longer than it (under load: prefill chunks shrink). Caps decoding_max_num_tokens, if given."})
    schedule_from_step_time: bool = field(default=False, metadata={
        "help": "Set decoding_max_num_tokens and short_prompt_lead_s from this engine's own step time a + b x tokens, "
                "fitted from the steps it runs and refitted as it serves: the smallest budget whose fixed cost a is "
                "<= 10% of a step, and the longest prompt's prefill time (b x max_input_len, as by default). A knob "
                "given explicitly stays as given. stats()['config'] shows the fit and the knobs."})
    kv_cache_memory_fraction: float | None = field(default=0.9, metadata={
        "help": "Share of the memory available after the engine is loaded given to the KV pool."})
    max_kv_cache_tokens: int | None = field(default=None, metadata={
        "help": "Absolute cap on the KV pool in tokens (the smaller limit wins)."})
    capacity_policy: str = field(default="guaranteed_no_evict", metadata={
        "choices": CAPACITY_POLICIES,
        "help": "guaranteed_no_evict: admit a request only when its prompt + max_tokens fit; max_utilization: "
                "admit greedily, preempt (lowest priority, latest first) when blocks run out."})
    batch_max_share: float = field(default=1 / 16, metadata={
        "help": "Most of a step's token budget batch work (kiln run-batch, /v1/batches: the lowest priority) takes "
                "while no online request is running or waiting, in (0, 1]: it bounds the step an arriving online "
                "request waits for (kiln run-batch, with no online traffic, defaults to 1)."})
    batch_min_share: float = field(default=1 / 128, metadata={
        "help": "Share of each step's token budget batch work gets while online requests are running or waiting, "
                "in (0, batch_max_share]: online work never takes it (batch always progresses) and batch never "
                "spends more (online steps stay short); unspent share carries over up to one KV block."})
    enable_prefix_reuse: bool = field(default=True, metadata={
        "help": "Share the KV blocks of common prefixes between requests."})
    seed: int | None = field(default=None, metadata={
        "help": "Seed of the generator used by requests without their own seed."})
    metrics_window: int = field(default=4096, metadata={"help": "Steps kept for the recent-steps summary."})
    grammar_cache_size: int = field(default=256, metadata={
        "help": "Compiled structured-output grammars kept for reuse (least recently used go first)."})
    grammar_compile_threads: int = field(default=1, metadata={
        "help": "Threads compiling structured-output grammars (off the step loop, scheduled SCHED_IDLE)."})
    max_loras: int = field(default=4, metadata={
        "help": "LoRA adapters resident at once in the adapter pool (an engine built with lora_target_modules); "
                "more can be loaded: they swap in, least recently used out, between steps."})
    speculative_config: str | dict | SpeculativeConfig | None = field(default=None, metadata={
        "help": "Speculative decoding, as a JSON object (vLLM's keys): e.g. '{\"method\": \"ngram\", "
                "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'; "
                "see docs/speculative.md."})

    def __post_init__(self) -> None:
        c = FieldChecks()
        for name in ("max_batch_size", "max_num_tokens", "decoding_max_num_tokens", "max_kv_cache_tokens"):
            setattr(self, name, c.integer(name, getattr(self, name), 1, optional=True))
        self.kv_cache_memory_fraction = c.number("kv_cache_memory_fraction", self.kv_cache_memory_fraction, 0, 1,
                                                 lo_open=True, optional=True)
        c.choice("capacity_policy", self.capacity_policy, CAPACITY_POLICIES)
        self.short_prompt_lead_s = c.number("short_prompt_lead_s", self.short_prompt_lead_s, 0, 3600, optional=True)
        self.tpot_target_s = c.number("tpot_target_s", self.tpot_target_s, 0, 3600)
        self.batch_max_share = c.number("batch_max_share", self.batch_max_share, 0, 1, lo_open=True)
        self.batch_min_share = c.number("batch_min_share", self.batch_min_share, 0, 1, lo_open=True)
        shares = (self.batch_min_share, self.batch_max_share)
        if all(isinstance(x, float) for x in shares) and shares[0] > shares[1]:
            c.problems.append(f"batch_min_share {self.batch_min_share} is above batch_max_share "
                              f"{self.batch_max_share}; lower the floor or raise the ceiling")
        self.enable_prefix_reuse = c.flag("enable_prefix_reuse", self.enable_prefix_reuse)
        self.schedule_from_step_time = c.flag("schedule_from_step_time", self.schedule_from_step_time)
        self.seed = c.integer("seed", self.seed, *SEED_RANGE, optional=True)
        self.metrics_window = c.integer("metrics_window", self.metrics_window, 1)
        self.grammar_cache_size = c.integer("grammar_cache_size", self.grammar_cache_size, 1)
        self.grammar_compile_threads = c.integer("grammar_compile_threads", self.grammar_compile_threads, 1)
        self.max_loras = c.integer("max_loras", self.max_loras, 1)
        try:
            self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        except ConfigError as exc:
            c.problems.append(str(exc))
        if c.problems:
            raise ConfigError("invalid ExecutorConfig: " + "; ".join(c.problems))


class CheckedRequest(NamedTuple):
    """A request that passed :meth:`Executor.validate`, its fields normalised."""

    token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    priority: int
    adapter: LoraAdapter | None = None


@dataclass(frozen=True)
class ServingLimits:
    """What an executor runs with: per-step budgets (the engine's bounds or lower) and the KV pool.

    available_bytes: the memory kv_cache_memory_fraction applied to (None when no fraction was set).
    """

    max_batch_size: int
    max_num_tokens: int
    num_blocks: int
    kv_plan: str
    available_bytes: int | None
    decoding_max_num_tokens: int | None = None


@dataclass
class _Import:
    """An imported request in the step loop: its record, what it brings, whether its blocks are taken yet."""

    request: Request
    meta: ImportMeta
    start_transfer: Callable[[str, list[int]], None]
    reserved: bool = False


def resolve_serving_limits(bounds: EngineBounds, kv_bytes_per_token: int, config: ExecutorConfig,
                           available_bytes: int | None = None) -> ServingLimits:
    """Per-step budgets and KV pool size for an engine's bounds and serving options.

    The executor calls this with the memory available now; the capacity planner (``kiln plan``) calls it
    with the memory a device will have left after the weights, so both size the pool the same way.
    """

    def bound(name: str, value: int | None) -> int:
        limit = getattr(bounds, name)
        if value is not None and value > limit:
            raise ConfigError(f"{name}={value} is above the engine's bound {limit} "
                              "(rebuild the engine to raise it)")
        return limit if value is None else value

    max_batch_size = bound("max_batch_size", config.max_batch_size)
    max_num_tokens = bound("max_num_tokens", config.max_num_tokens)
    decoding = config.decoding_max_num_tokens
    if decoding is not None:
        least = least_decoding_budget(max_batch_size, bounds.tokens_per_block)
        if decoding < least:
            raise ConfigError(f"decoding_max_num_tokens={decoding} leaves a step full of decodes no room for a prefill "
                              f"chunk: give at least max_batch_size - 1 + tokens_per_block = {least}")
        decoding = None if decoding >= max_num_tokens else decoding
    if config.kv_cache_memory_fraction is None:
        available_bytes = None
    elif available_bytes is None:
        available_bytes = available_memory_bytes()
    num_blocks, why = plan_num_blocks(
        kv_bytes_per_token, bounds.tokens_per_block, memory_fraction=config.kv_cache_memory_fraction,
        max_kv_cache_tokens=config.max_kv_cache_tokens, useful_tokens=2 * max_batch_size * bounds.max_seq_len,
        available_bytes=available_bytes,
    )
    if bounds.max_num_blocks and num_blocks > bounds.max_num_blocks:
        num_blocks = bounds.max_num_blocks
        why += f"; capped at the engine's max_num_blocks={num_blocks} (rebuild with a larger one to raise it)"
    return ServingLimits(max_batch_size, max_num_tokens, num_blocks, why, available_bytes, decoding)


class Executor:
    def __init__(self, engine, config: ExecutorConfig | None = None, tokenizer=None, start: bool = True):
        self.engine = engine
        self.config = config = config or ExecutorConfig()
        self.tokenizer = tokenizer
        b, model = engine.config.bounds, engine.config.model
        self.block_size = b.tokens_per_block
        self.vocab_size = model.vocab_size
        self.eos_token_ids = tuple(engine.config.tokenizer.eos_token_ids)

        layout = getattr(engine.config, "lora", None)
        lora_bytes = config.max_loras * layout.slot_bytes(engine.config.torch_dtype) if layout is not None else 0
        available = None   # the adapter pool (allocated below, untouched until filled) comes out of the KV share
        spec = config.speculative_config
        draft = self._load_draft(spec)   # before the memory is measured: its weights are not the KV pools'
        if lora_bytes and config.kv_cache_memory_fraction is not None:
            available = max(0, available_memory_bytes() - lora_bytes)
        # with a draft model both pools come out of one budget, split by bytes per token so that both hold the
        # same tokens (every speculating sequence lives in both)
        kv_bytes = engine.kv_bytes_per_token + (draft.kv_bytes_per_token if draft is not None else 0)
        self.limits = limits = resolve_serving_limits(b, kv_bytes, config, available)
        sched_config = SchedulerConfig(limits.max_batch_size, limits.max_num_tokens, b.max_seq_len, b.max_input_len,
                                       config.capacity_policy, config.batch_max_share, config.batch_min_share,
                                       b.max_num_logits, limits.decoding_max_num_tokens,
                                       short_prompt_lead_s=config.short_prompt_lead_s or 0.0,   # 0 until fitted
                                       tpot_target_s=config.tpot_target_s)
        num_blocks = limits.num_blocks
        logger.info(limits.kv_plan)
        self.kv_plan = limits.kv_plan
        if lora_bytes:
            self.kv_plan += (f"; LoRA adapter pool: {config.max_loras} slots x "
                             f"{lora_bytes // config.max_loras / 2**20:.1f} MiB")
        # zero pages: no zeroing pass (which, as a 2-thread OpenMP loop on this thread, would give the process a
        # second OpenMP team: kiln.plugins.openmp_teams), and the pool resident only as blocks are written
        self.kv_cache = engine.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, self.block_size, config.enable_prefix_reuse, model.kv_window)
        self.adapters: AdapterRegistry | None = None   # loaded LoRA adapters by name (an engine that takes them)
        self.adapter_pool: AdapterPool | None = None   # their resident slots (the step loop's)
        if layout is not None:
            self.adapters = AdapterRegistry(layout, engine.config.torch_dtype)
            # not zeroed: a slot is read only by tokens of the adapter written into it (whole rows)
            self.adapter_pool = AdapterPool(engine.allocate_lora_pool(config.max_loras, zeroed=False))
        self.scheduler = Scheduler(sched_config, self.kv, self.adapter_pool)
        # the knobs the step-time fit sets: the lead unless given, the decoding budget only when asked to
        fit_sets = {
            "decoding_max_num_tokens": config.schedule_from_step_time and config.decoding_max_num_tokens is None,
            "short_prompt_lead_s": config.short_prompt_lead_s is None}
        self.step_knobs = None   # the engine's step time, fitted as it serves (the pace, the knobs it sets)
        if config.tpot_target_s or any(fit_sets.values()):
            fixed = frozenset(name for name, sets in fit_sets.items() if not sets)
            self.step_knobs = StepTimeKnobs(sched_config, self.block_size, fixed)
        self.sampler = Sampler(self.vocab_size, config.seed)
        self.metrics = RuntimeMetrics(config.metrics_window)
        self.proposer = self._make_proposer(spec, draft)
        self.metrics.gauges["kv_blocks_total"] = num_blocks
        self._kv_stats = self.kv.stats().as_dict()

        self._cv = threading.Condition()
        self._incoming: list[tuple[Request, Future | None]] = []   # with its grammar on the way, if it has one
        self._grammars: GrammarCompiler | None = None   # made at the first structured-output request
        self._grammars_lock = threading.Lock()
        self._compiling: list[tuple[Request, Future]] = []   # waiting for their grammar (loop thread)
        self._grammar_ready = False                          # a grammar finished compiling (guarded by _cv)
        self._aborts: list[str] = []
        self._live: set[str] = set()          # ids submitted and not yet finished (guarded by _cv)
        self._streams: dict[str, OutputStream] = {}   # by request id, until the request ends (loop thread)
        self._requests: dict[str, Request] = {}       # the same requests' records (loop thread)
        self._step_failures = 0                       # consecutive failed engine steps
        self.team_watch = TeamWatch()                 # is the step loop's OpenMP team still spinning? (loop thread)
        self._exports: dict[str, Callable[[KVExport], None]] = {}   # kv_export of requests not yet prefilled
        self._incoming_imports: list[_Import] = []     # submit_imported, not yet seen by the loop (guarded by _cv)
        self._landed: list[tuple[str, torch.Tensor | BaseException]] = []   # land() (guarded by _cv)
        self._imports: dict[str, _Import] = {}         # imports waiting for blocks or for them to land (loop thread)
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    def _load_draft(self, spec: SpeculativeConfig | None):
        """The draft engine of a draft_model configuration (checked against this engine), else None."""
        if spec is None or spec.method != "draft_model":
            return None
        from kiln.runtime.draft_model import load_draft

        return load_draft(spec.model, self.engine)

    def _make_proposer(self, spec: SpeculativeConfig | None, draft) -> Proposer | None:
        if spec is None:
            return None
        if draft is None:
            return NgramProposer(spec)
        from kiln.runtime.draft_model import DraftProposer, draft_pool_blocks

        blocks = draft_pool_blocks(self.limits.num_blocks, self.block_size, draft.config.bounds)
        self.kv_plan += (f"; draft engine's pool: {blocks} blocks x {draft.config.bounds.tokens_per_block} tokens "
                         f"({draft.kv_bytes_per_token} B/token; the budget split by bytes per token, "
                         "both pools hold the same tokens)")
        return DraftProposer(spec, draft, blocks, self.sampler, self.config.enable_prefix_reuse)

    # ---- public, any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kiln-step-loop", daemon=True)
            _RUNNING.add(self)
            self._thread.start()

    def in_loop_thread(self) -> bool:
        """Is the caller the step loop itself (an output callback)? It must not wait for the loop then."""
        return self._thread is threading.current_thread()

    def validate(self, prompt: Any, params: SamplingParams | None = None, *, priority: Any = 0,
                 request_id: Any = None, callback: Any = None, arrival_time: Any = None,
                 lora: Any = None, kv_transfer: bool = False) -> CheckedRequest:
        """Check one request in the caller's thread: its token ids (see ``kiln.runtime.prompts``), every
        SamplingParams field again (it may have changed since construction) and the engine's limits, the
        priority, id, callback and arrival time, and the LoRA adapter it names (``lora``: a loaded adapter's name,
        None for the base model). ``kv_transfer``: the request's KV blocks move between executors
        (``kiln.runtime.kv_transfer``), which carry no adapter or grammar state yet: a LoRA adapter or structured
        output is refused first (the one place that refusal is made: export, import and the disaggregated
        frontend all ask for it). Returns the normalised request; raises InvalidRequestError
        or ConfigError (both ValueErrors, counted as rejected). Nothing is queued."""
        try:
            return self._check(prompt, params, priority, request_id, callback, arrival_time, lora, kv_transfer)
        except (InvalidRequestError, ConfigError):
            self.metrics.incr("requests_rejected")
            raise

    def _check(self, prompt, params, priority, request_id, callback, arrival_time, lora,
               kv_transfer: bool = False) -> CheckedRequest:
        ids = checked_token_ids(prompt)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.check()
        refusal = untransferable(lora, params.structured_output) if kv_transfer else None
        if refusal is not None:
            raise refusal
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; the engine directory has no tokenizer.json")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidRequestError(f"logprobs={params.logprobs} exceeds the vocabulary size {self.vocab_size}")
        if params.structured_output is not None:
            self.grammar_compiler().prepare(params.structured_output)
        if not is_integer(priority):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r:.40} ({type(priority).__name__})")
        if request_id is not None and not (isinstance(request_id, str) and request_id):
            raise InvalidRequestError(f"request_id must be a non-empty str, got {request_id!r:.40}")
        if callback is not None and not callable(callback):
            raise InvalidRequestError(f"callback must be callable, got {type(callback).__name__}")
        if arrival_time is not None and not (isinstance(arrival_time, numbers.Real) and math.isfinite(arrival_time)):
            raise InvalidRequestError(f"arrival_time must be a finite number (time.monotonic()), got {arrival_time!r}")
        adapter = self._adapter(lora)
        max_tokens = self.scheduler.resolve_max_tokens(len(ids), params.max_tokens)
        return CheckedRequest(ids, params, max_tokens, int(priority), adapter)

    def _adapter(self, lora: Any) -> LoraAdapter | None:
        """The loaded adapter a request names (InvalidRequestError for an unknown name, or any name on an engine
        without adapters)."""
        if lora is None:
            return None
        if not isinstance(lora, str):
            raise InvalidRequestError(f"lora must be a loaded LoRA adapter's name (str) or None, got {lora!r:.40}")
        if self.adapters is None:
            raise InvalidRequestError(f"lora={lora!r}: this engine takes no LoRA adapters; rebuild it with "
                                      "--lora-target-modules")
        return self.adapters.get(lora)

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output grammar compiler over this engine's vocabulary (made on first use: it needs
        xgrammar and the tokenizer; InvalidRequestError says which is missing)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("structured output needs the tokenizer's vocabulary; the engine "
                                              "directory has no tokenizer.json")
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, list(self.eos_token_ids),
                                                 self.metrics, cache_size=self.config.grammar_cache_size,
                                                 threads=self.config.grammar_compile_threads)
            return self._grammars

    def submit(self, prompt_token_ids: Any, params: SamplingParams | None = None, *,
               request_id: str | None = None, priority: int = 0, prompt: str | None = None,
               callback: Callable[[RequestOutput], None] | None = None, arrival_time: float | None = None,
               lora: str | None = None, kv_export: Callable[[KVExport], None] | None = None,
               paced: bool = True) -> str:
        """Queue a request (token ids, any form :func:`kiln.runtime.prompts.prompt_token_ids` accepts); returns
        its id. ``callback`` receives a RequestOutput after every step that changed it (from the step-loop
        thread; keep it short) and once more when it finishes. ``lora``: a loaded adapter's name. ``paced``:
        its decode steps keep ``tpot_target_s`` (False: nobody reads its tokens as they come, e.g. ``generate``).
        ``kv_export``: called (in the step loop, once) with the request's prompt blocks when its first token is
        sampled (``kiln.runtime.kv_transfer``: how a prefill worker hands a request to a decode worker)."""
        checked = self.validate(prompt_token_ids, params, priority=priority, request_id=request_id,
                                callback=callback, arrival_time=arrival_time, lora=lora,
                                kv_transfer=kv_export is not None)
        engine_failure = self.engine.failure   # a tensor-parallel rank died while idle
        if engine_failure is not None:
            self.metrics.incr("requests_rejected")
            raise ExecutorClosedError(f"the engine cannot run: {engine_failure}; recreate the LLM")
        spec = checked.params.structured_output
        grammar = None if spec is None else self._claim_grammar(spec)
        with self._cv:
            req = self._register(checked, request_id, arrival_time, prompt, callback, paced)
            request_id = req.request_id
            if kv_export is not None:
                self._exports[request_id] = kv_export
            self._incoming.append((req, grammar))
            self._cv.notify()
        if grammar is not None:
            grammar.add_done_callback(self._compiled)
            self.metrics.incr("structured_requests")
        self.metrics.incr("requests_submitted")
        self.metrics.incr("prompt_tokens", len(checked.token_ids))
        return request_id

    def submit_imported(self, prompt_token_ids: Any, params: SamplingParams | None, meta: ImportMeta,
                        start_transfer: Callable[[str, list[int]], None], *, request_id: str, priority: int = 0,
                        prompt: str | None = None, callback: Callable[[RequestOutput], None] | None = None,
                        arrival_time: float | None = None, paced: bool = True) -> str:
        """Queue a request another executor prefilled (``kiln.runtime.kv_transfer``): the step loop allocates its
        blocks (when they fit, counting them with the running requests'), then calls ``start_transfer(request_id,
        block ids)`` (in the loop; it starts receiving them); once :meth:`land` delivers the blocks, the request
        runs from its first token (``meta.first_token``, emitted then), as if it had been prefilled here.
        ``start_transfer`` is called exactly once, also for a request aborted before its blocks were taken (with
        no block ids: receive and drop them), so the sending side is never left waiting.
        ``paced`` as for :meth:`submit`. Errors as for :meth:`submit`; a shape that is not this pool's is an
        InvalidRequestError."""
        checked = self.validate(prompt_token_ids, params, priority=priority, request_id=request_id,
                                callback=callback, arrival_time=arrival_time, kv_transfer=True)
        want = cdiv(len(checked.token_ids), self.block_size)
        pool = tuple(self.kv_cache.shape)
        if (meta.num_blocks != want or tuple(meta.shape[:2]) != pool[:2] or tuple(meta.shape[3:]) != pool[3:]
                or meta.dtype != str(self.kv_cache.dtype)):
            self.metrics.incr("requests_rejected")
            raise InvalidRequestError(f"imported KV blocks {meta.shape} {meta.dtype} do not fit this pool "
                                      f"({want} blocks of {pool[:2] + pool[3:]} {self.kv_cache.dtype}): the two "
                                      "workers must serve the same engine")
        with self._cv:
            req = self._register(checked, request_id, arrival_time, prompt, callback, paced)
            self._incoming_imports.append(_Import(req, meta, start_transfer))
            self._cv.notify()
        self.metrics.incr("requests_submitted")
        self.metrics.incr("prompt_tokens", len(checked.token_ids))
        return request_id

    def _register(self, checked, request_id: str | None, arrival_time: float | None, prompt: str | None,
                  callback: Callable[[RequestOutput], None] | None, paced: bool = True) -> Request:
        """The Request of a checked submission, its id (a fresh one for None) unique among live requests, and its
        output stream (the caller holds ``_cv``; submit and submit_imported)."""
        if self._closed or self._error is not None:
            raise ExecutorClosedError(self.failure or "the executor is closed")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._live:
                request_id = f"req-{next(self._ids)}"
        elif request_id in self._live:
            self.metrics.incr("requests_rejected")
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = Request(request_id, checked.token_ids, checked.params, checked.max_tokens,
                      priority=checked.priority, arrival_time=arrival_time, seq=next(self._seq), prompt=prompt,
                      eos_token_ids=self.eos_token_ids, adapter=checked.adapter, paced=paced)
        self._streams[request_id] = OutputStream.open(req, self.tokenizer, callback)
        self._requests[request_id] = req
        self._live.add(request_id)
        return req

    def land(self, request_id: str, blocks: torch.Tensor | BaseException) -> None:
        """The blocks of an imported request arrived (any thread), or their transfer failed (an exception:
        only that request ends, with the error)."""
        with self._cv:
            if request_id in self._live:
                self._landed.append((request_id, blocks))
                self._cv.notify()

    def _claim_grammar(self, spec) -> Future:
        """The compiled grammar of a validated constraint, ready or on its way (validation parsed it; should
        it have left the cache since, it is parsed again, and a refusal is counted as a rejection)."""
        try:
            return self.grammar_compiler().claim(spec)
        except InvalidRequestError:
            self.metrics.incr("requests_rejected")
            raise

    def _compiled(self, _future: Future) -> None:
        """A grammar finished compiling (any thread): wake the loop, which may be idle, to admit its requests."""
        with self._cv:
            self._grammar_ready = True
            self._cv.notify()

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
            "decoding_max_num_tokens": self.scheduler.config.decoding_max_num_tokens,
            "short_prompt_lead_s": self.scheduler.config.short_prompt_lead_s,
            "tpot_target_s": self.scheduler.config.tpot_target_s,
        }
        if self.step_knobs is not None:
            snap["config"]["step_time_fit"] = self.step_knobs.as_dict()
        snap["openmp"] = {"region_us": self.team_watch.region_us, "contended": self.team_watch.contended}
        if self.adapter_pool is not None:
            snap["lora"] = {"loaded": self.adapters.names(), **self.adapter_pool.stats()}
        if self.proposer is not None:
            snap["speculative"]["config"] = self.config.speculative_config.as_dict()
        return snap

    @property
    def failure(self) -> str | None:
        """Why the step loop no longer serves (closed, or the error that stopped it); None while it serves.
        Health checks read this."""
        with self._cv:
            if self._error is not None:
                return f"the step loop failed: {type(self._error).__name__}: {self._error}"
            if self._closed:
                return "the executor is closed"
        engine_failure = self.engine.failure
        if engine_failure is not None:
            return f"the engine cannot run: {engine_failure}"
        if self._thread is None or not self._thread.is_alive():
            return "the step loop is not running"
        return None

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

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop the loop; requests still queued or running end with finish_reason "abort". ``wait``: join the
        loop thread (at most ``timeout`` seconds), unless called from it."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("the step loop did not stop within %s s", timeout)
        if self.proposer is not None and (thread is None or not thread.is_alive()):
            self.proposer.close()

    # ---- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # the books are in doubt, or the engine is broken: stop, loudly
            self._fail(exc)

    def _serve(self) -> None:
        sched = self.scheduler
        while True:
            with self._cv:
                while not (self._incoming or self._aborts or self._closed or sched.has_unfinished()
                           or self._grammar_ready or self._incoming_imports or self._landed):
                    self._cv.wait()
                incoming, self._incoming = self._incoming, []
                aborts, self._aborts = self._aborts, []
                closed, self._grammar_ready = self._closed, False
                imports, self._incoming_imports = self._incoming_imports, []
                landed, self._landed = self._landed, []
            for req, grammar in incoming:
                if grammar is None:
                    sched.add_request(req)
                else:
                    self._compiling.append((req, grammar))
            self._imports.update((imp.request.request_id, imp) for imp in imports)
            self._admit_compiled()
            self._admit_landed(landed)
            self._end(sched.finish_requests(aborts, RequestStatus.FINISHED_ABORTED) + self._drop_compiling(aborts)
                      + self._drop_imports(aborts))
            if closed:
                self._end(sched.finish_requests(sched.unfinished_ids(), RequestStatus.FINISHED_ABORTED)
                          + self._drop_compiling([req.request_id for req, _ in self._compiling])
                          + self._drop_imports(list(self._imports)))
                if self._grammars is not None:
                    self._grammars.close()
                return
            self._reserve_imports()
            if sched.has_unfinished():
                self.team_watch.check()   # on this thread: its team is the steps'
                self.step()
            else:   # no step to refresh them: requests that arrived (or left) while idle still show in the gauges
                self._refresh_gauges()

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready get their matcher and join the scheduler (in arrival order: it
        sorts its queue); one whose grammar failed to compile ends with the error."""
        if not self._compiling:
            return
        waiting, failed = [], []
        for req, grammar in self._compiling:
            if not grammar.done():
                waiting.append((req, grammar))
            elif grammar.exception() is not None:
                self._streams[req.request_id].error = f"the grammar failed to compile: {grammar.exception()}"
                req.status = RequestStatus.FINISHED_ABORTED
                req.metrics.finished_time = time.monotonic()
                failed.append(req)
            else:
                req.grammar = self._grammars.matcher(grammar.result(), req.params.stop_token_ids)
                self.scheduler.add_request(req)
        self._compiling = waiting
        self._end(failed)

    # ---- KV import / export (kiln.runtime.kv_transfer) -------------------------------------------------
    def _reserve_imports(self) -> None:
        """Take blocks for the imported requests, first come first served, while they fit: a seat each (running
        requests and imports in transfer count) and, under guaranteed_no_evict, their whole span on top of what
        running requests may still claim; then their transfer may start."""
        sched = self.scheduler
        no_evict = sched.config.capacity_policy == "guaranteed_no_evict"
        seats = sched.num_running + sum(imp.reserved for imp in self._imports.values())
        for rid, imp in list(self._imports.items()):
            if imp.reserved:
                continue
            req = imp.request
            tokens = req.num_prompt_tokens + (req.max_tokens - 1 if no_evict else 0)
            if seats >= sched.config.max_batch_size or not self.kv.allocate_slots(
                    req, max(tokens, req.num_prompt_tokens), keep_free=sched.reserved_blocks() if no_evict else 0):
                return
            imp.reserved = True
            seats += 1
            try:
                imp.start_transfer(rid, self.kv.block_table(rid)[:imp.meta.num_blocks])
            except Exception as exc:
                logger.exception("starting the KV transfer of %s failed", rid)
                self._fail_import(imp, f"starting the KV transfer failed: {type(exc).__name__}: {exc}")

    def _fail_import(self, imp: _Import, error: str) -> None:
        del self._imports[imp.request.request_id]
        self.kv.free(imp.request)
        self._streams[imp.request.request_id].error = error
        imp.request.status = RequestStatus.FINISHED_ABORTED
        imp.request.metrics.finished_time = time.monotonic()
        self._end([imp.request])

    def _admit_landed(self, landed: list[tuple[str, torch.Tensor | BaseException]]) -> None:
        """Imported requests whose blocks arrived: copy them into the pool, run them from their first token."""
        for rid, blocks in landed:
            imp = self._imports.get(rid)
            if imp is None or not imp.reserved:
                continue
            if isinstance(blocks, BaseException):
                self._fail_import(imp, f"the KV transfer failed: {type(blocks).__name__}: {blocks}")
                continue
            del self._imports[rid]
            req, meta = imp.request, imp.meta
            table = torch.tensor(self.kv.block_table(rid)[:meta.num_blocks], dtype=torch.int64)
            self.kv_cache.index_copy_(2, table.to(self.kv_cache.device), blocks.to(self.kv_cache.device))
            req.num_computed_tokens = req.num_prompt_tokens
            req.metrics.first_scheduled_time = meta.first_scheduled_time or time.monotonic()
            req.metrics.num_cached_tokens = meta.num_cached_tokens
            if meta.generator_state is not None:
                req.generator = torch.Generator()
                req.generator.set_state(meta.generator_state)
            self.scheduler.add_imported(req)
            self.kv.cache_blocks(req)
            req.append_token(meta.first_token)
            self._emit_outputs([(req, meta.first_token)], [meta.logprobs])

    def _drop_imports(self, request_ids: list[str]) -> list[Request]:
        """Take the imports among ``request_ids`` out, their blocks back (they end as aborted; a transfer still
        landing is ignored: it fills a buffer of its own, not the pool)."""
        dropped = []
        for rid in request_ids:
            imp = self._imports.pop(rid, None)
            if imp is not None:
                if not imp.reserved:
                    try:
                        imp.start_transfer(rid, [])
                    except Exception:
                        logger.exception("draining the KV transfer of %s failed", rid)
                self.kv.free(imp.request)
                imp.request.status = RequestStatus.FINISHED_ABORTED
                imp.request.metrics.finished_time = time.monotonic()
                dropped.append(imp.request)
        return dropped

    def _export(self, req: Request, token: int, logprobs: dict | None, export: Callable[[KVExport], None]) -> None:
        """Hand a prefilled request's prompt blocks (a copy, in the pool's layout) to its ``kv_export``."""
        n = cdiv(req.num_computed_tokens, self.block_size)
        table = torch.tensor(self.kv.block_table(req.request_id)[:n], dtype=torch.int64, device=self.kv_cache.device)
        m = req.metrics
        try:
            export(KVExport(req.request_id, self.kv_cache.index_select(2, table), token, logprobs,
                            req.generator.get_state() if req.generator is not None else None,
                            m.first_scheduled_time, m.first_token_time, m.num_cached_tokens))
        except Exception:
            logger.exception("kv_export of %s failed", req.request_id)

    def _drop_compiling(self, request_ids: list[str]) -> list[Request]:
        """Take the requests among ``request_ids`` that still wait for their grammar out (they end as aborted)."""
        ids = set(request_ids)
        dropped = [req for req, _ in self._compiling if req.request_id in ids]
        if dropped:
            self._compiling = [(req, g) for req, g in self._compiling if req.request_id not in ids]
            now = time.monotonic()
            for req in dropped:
                req.status = RequestStatus.FINISHED_ABORTED
                req.metrics.finished_time = now
        return dropped

    def _fail(self, exc: BaseException) -> None:
        """Stop serving: record why, end every request in flight with that error, refuse new work."""
        logger.error("step loop failed: %s", "".join(traceback.format_exception(exc)))
        error = f"the step loop failed: {type(exc).__name__}: {exc}"
        with self._cv:
            self._error = exc
            self._incoming.clear()   # their streams and records are in _streams/_requests: ended below
            self._aborts.clear()
        self._compiling.clear()
        self._imports.clear()
        if self._grammars is not None:
            self._grammars.close()
        for stream in self._streams.values():
            stream.error = error
        try:
            self._end(self.scheduler.finish_requests(self.scheduler.unfinished_ids(), RequestStatus.FINISHED_ABORTED))
        except BaseException:
            logger.exception("the scheduler could not end the requests in flight; ending them directly")
        for req in list(self._requests.values()):   # not in the scheduler yet, or its books are broken
            req.status = RequestStatus.FINISHED_ABORTED
            self._end([req])

    def step(self) -> None:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.preempted and self.proposer is not None:
            self.proposer.release(out.preempted)   # a draft's blocks go with the target's
        if not out:
            time.sleep(0.001)  # nothing fits right now (cannot last: admission checks guarantee progress)
            return
        spec = out.num_spec_tokens > 0   # False: exactly the step without speculation
        try:
            inputs, rows = self._pack(out, spec)
            t1 = time.perf_counter()
            logits = self.engine.run(inputs)   # num_logits may be 0: a step of non-final prefill chunks
            engine_time = time.perf_counter() - t1
            if spec:
                sample, sampled, accepted = self._verify(out, rows, logits)
            else:
                sample = self.sampler(logits, [out.scheduled[i].request for i in rows]) if rows else None
        except Exception as exc:
            self._fail_step(out, exc)
            return
        self._step_failures = 0
        if not spec:
            sampled = {i: sample.token_ids[j] for j, i in enumerate(rows)} if sample else {}
            accepted = None
        new_tokens = self.scheduler.update_from_output(out, sampled, accepted)
        if spec:
            self.proposer.rolled_back([s.request for s in out.scheduled if s.num_spec])
        self._emit_outputs(new_tokens, sample.logprobs if sample else [], spec)
        step_time = time.perf_counter() - t0
        self._record_step(out, len(new_tokens), step_time, engine_time, sample.mask_time if sample else None)
        if self.proposer is not None:
            self._propose(out, step_time)

    def _verify(self, out: SchedulerOutput, rows: list[int], logits: torch.Tensor):
        """Verify the speculating sequences' proposals. Point-mass proposals (n-gram, and any proposer's for a
        greedy request): sample the target at every position, each position seeing the proposals before it as
        generated, and accept while they equal the target's token, which is rejection sampling for point masses
        (``kiln.runtime.speculative``). The rows of requests the sampler would only argmax (``argmax_only``) take
        one argmax over them all, without the sampler; the others take one sampler call. A seeded request draws
        position j's noise as its j-th draw without speculation would, so its tokens are those it would generate
        without speculation (its generator is wound back over the draws of rejected positions). A draft model's
        proposals for a sampled request: rejection sampling with the draft's q (``kiln.runtime.rejection``).
        Returns the sampler's output (logprobs in emission order), index -> the token after the accepted
        proposals, and index -> the accepted proposals."""
        plain: list[int] = []   # logits rows of argmax-only requests
        views: list = []        # the sampler's rows: Position views of speculating requests, or requests
        view_rows: list[int] = []
        spans = []              # (index in out.scheduled, its first logits row, its proposals)
        seeded = {}   # request id -> its generator's state before this step's draws
        drafted = {}  # index -> the draft's distribution of its proposals
        r = 0
        for i in rows:
            s = out.scheduled[i]
            req, k = s.request, s.num_spec
            spans.append((i, r, k))
            if Sampler.argmax_only(req):
                plain.extend(range(r, r + k + 1))
            elif k:
                view_rows.extend(range(r, r + k + 1))
                views.extend(Position(req, j) for j in range(k + 1))
                q = self.proposer.draft_probs(req.request_id) if req.params.temperature > 0 else None
                if q is not None:
                    drafted[i] = q[:k]
                elif req.generator is not None and req.params.temperature > 0:
                    seeded[req.request_id] = req.generator.get_state()
            else:
                view_rows.append(r)
                views.append(req)
            r += k + 1
        tokens: list = [None] * r
        logprobs: list = [None] * r
        mask_time = None
        if plain:
            picked = (logits if len(plain) == r else logits[plain]).argmax(dim=1).tolist()
            for x, t in zip(plain, picked):
                tokens[x] = t
        if views:
            part = logits if len(view_rows) == r else logits[view_rows]
            if drafted:
                sample = self._sample_undrafted(part, views, view_rows, spans, drafted)
            else:
                sample = self.sampler(part, views)
            mask_time = sample.mask_time
            for x, t, lp in zip(view_rows, sample.token_ids, sample.logprobs):
                tokens[x], logprobs[x] = t, lp
        sampled, accepted, emitted = {}, {}, []
        for i, r, k in spans:
            if k:
                req = out.scheduled[i].request
                drafts = req.spec_token_ids[:k]
                if i in drafted:
                    v = view_rows.index(r)
                    a, token, lps = verify_drafted(self.sampler, logits[r:r + k + 1], views[v:v + k + 1], drafts,
                                                   drafted[i])
                else:
                    a = 0
                    while a < k and tokens[r + a] == drafts[a]:
                        a += 1
                    token, lps = tokens[r + a], logprobs[r:r + a + 1]
                    if a < k and req.request_id in seeded:   # its stream advances by the tokens it kept, as
                        self.sampler.replay(req.generator, seeded[req.request_id], a + 1)   # without speculation
                accepted[i] = drafts[:a]
                self.proposer.record(req.request_id, k, a)
                self.metrics.record_speculation(k, a)
                emitted.extend(lps)
                sampled[i] = token
            else:
                emitted.append(logprobs[r])
                sampled[i] = tokens[r]
        return SamplerOutput(tokens, emitted, mask_time), sampled, accepted

    def _sample_undrafted(self, logits: torch.Tensor, views: list, view_rows: list[int], spans, drafted: dict):
        """The sampler over the rows (``views``, at logits rows ``view_rows``) the rejection sampler does not take
        (placeholders at the drafted rows, so that indices stay those of ``views``)."""
        skip = set()
        for i, r, k in spans:
            if i in drafted:
                skip.update(range(r, r + k + 1))
        keep = [x for x, r in enumerate(view_rows) if r not in skip]
        part = self.sampler(logits[keep], [views[x] for x in keep]) if keep else SamplerOutput([], [])
        tokens, logprobs = [-1] * len(views), [None] * len(views)
        for x, t, lp in zip(keep, part.token_ids, part.logprobs):
            tokens[x], logprobs[x] = t, lp
        return SamplerOutput(tokens, logprobs, part.mask_time)

    def _propose(self, out: SchedulerOutput, step_time: float) -> None:
        """After a step (``out``, ``step_time`` seconds): proposals for the decoding requests' next step, each
        one's k from the proposer's policy (measured costs and acceptance, ``kiln.runtime.spec_policy``, which the
        step's cost informs); nothing at all, not even the cost's record, while more sequences run than
        ``disable_by_batch_size`` when it is set; none for structured output."""
        sched, proposer = self.scheduler, self.proposer
        cap = proposer.config.disable_by_batch_size
        if cap is not None and sched.num_running > cap:
            return
        proposer.policy.observe_step(out.num_tokens, step_time)
        # the logits rows the next step can give proposals (each sequence that may run keeps one, as the scheduler
        # counts them): more would be dropped there, after a draft model had spent its rounds on them
        c = sched.config
        rows = (c.max_num_logits or c.max_num_tokens) - min(c.max_batch_size, sched.num_running + sched.num_waiting)
        candidates, base, decoding = [], 0, 0
        for req in sched.running:
            left = req.num_tokens - req.num_computed_tokens
            base += left
            decoding += left == 1
            if req.spec_token_ids or req.grammar is not None or left != 1:
                continue
            k = req.max_tokens - req.num_output_tokens - 1
            if k > 0:
                candidates.append((req, k))
        if not candidates or rows <= 0:
            return

        def choose(cands: list) -> list[int]:
            return proposer.policy.choose([(req.request_id, k, proposer.fixed_k(req)) for req, k in cands],
                                          min(base, c.max_num_tokens), decoding, rows)

        if proposer.round_per_position:   # a draft model: its rounds cost engine steps, so k is chosen first
            wants = [(req, k) for (req, _), k in zip(candidates, choose(candidates)) if k > 0]
            if wants:
                proposer.propose_all(wants)   # its rounds for all of them together
            return
        # a lookup (n-gram) costs microseconds: look first, and weigh only the requests it found proposals for
        # (most steps of text that does not repeat find none, and the policy's choice cost more than the lookup)
        proposer.propose_all([(req, min(k, proposer.policy.k)) for req, k in candidates])
        found = [(req, len(req.spec_token_ids)) for req, _ in candidates if req.spec_token_ids]
        if found:
            for (req, _), k in zip(found, choose(found)):
                del req.spec_token_ids[k:]

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> None:
        """The engine raised on this step: end its requests with the error (see the module docstring for why
        the pool stays sound), or stop the executor when the engine keeps failing."""
        if isinstance(exc, EngineDeadError):   # no step can run any more (a tensor-parallel rank is gone): stop now
            raise exc
        self._step_failures += 1
        logger.error("engine step failed (%d in a row): %s", self._step_failures,
                     "".join(traceback.format_exception(exc)))
        if self._step_failures >= MAX_STEP_FAILURES:
            raise RuntimeError(f"the engine failed {self._step_failures} steps in a row (last: "
                               f"{type(exc).__name__}: {exc})") from exc
        ids = [s.request.request_id for s in out.scheduled]
        for rid in ids:
            self._streams[rid].error = (f"the engine failed on this request's step ({type(exc).__name__}: {exc}); "
                                        "other requests go on")
        self._end(self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED))

    def _pack(self, out: SchedulerOutput, spec: bool = False) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Contract inputs for the scheduled tokens; also which scheduled entries produce logits (``spec``: a
        speculating sequence feeds its proposals after its last token and gets logits for all of them)."""
        if spec:
            chunks = [SeqChunk(s.request.all_token_ids[s.start:s.start + s.num_new_tokens - s.num_spec]
                               + s.request.spec_token_ids[:s.num_spec], s.start,
                               self.kv.block_table(s.request.request_id), 1 + s.num_spec if s.samples else 0,
                               s.request.lora_slot)
                      for s in out.scheduled]
        else:
            chunks = [SeqChunk(s.request.all_token_ids[s.start:s.start + s.num_new_tokens], s.start,
                               self.kv.block_table(s.request.request_id), 1 if s.samples else 0, s.request.lora_slot)
                      for s in out.scheduled]
        rows = [i for i, s in enumerate(out.scheduled) if s.samples]
        pool = self.adapter_pool.weights if self.adapter_pool is not None else None
        return pack_inputs(chunks, self.kv_cache, self.block_size, lora_weights=pool), rows

    def _emit_outputs(self, new_tokens: list[tuple[Request, int]], logprobs: list, spec: bool = False) -> None:
        """Token times, logprobs and text of each new token; the stop rules end requests through the
        scheduler; every changed request's output goes to its callback. ``spec``: a request may have several
        new tokens (in order); a stop drops those after it, and its output goes out after its last one."""
        now = time.monotonic()
        ended: list[Request] = []
        rest = 0   # the request's new tokens after this one
        for j, (req, token) in enumerate(new_tokens):
            if spec:
                if req.is_finished:
                    continue   # a stop earlier in this step ended it: the tokens past the stop are dropped
                rest = 0
                while j + 1 + rest < len(new_tokens) and new_tokens[j + 1 + rest][0] is req:
                    rest += 1
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            else:
                self.metrics.observe("inter_token_latency", now - m.last_token_time)
            m.last_token_time = now
            m.num_generated_tokens = req.num_output_tokens - rest
            if req.logprobs is not None:
                req.logprobs.append(logprobs[j])
            export = self._exports.pop(req.request_id, None) if self._exports else None
            if export is not None:
                self._export(req, token, logprobs[j] if req.logprobs is not None else None, export)
            stream = self._streams[req.request_id]
            if req.grammar is not None and not req.grammar.accept(token):   # the mask allowed it: a bug
                stream.error = f"the grammar rejected the sampled token {token}; the request was ended"
                logger.error("%s: %s", req.request_id, stream.error)
                ended += self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
                continue
            stop = stop_by_token(req, self.scheduler.config.max_seq_len, req.num_output_tokens - rest)
            stop_string = stream.add_token(token, last=stop is not None)
            if stop_string is not None:
                stop = (RequestStatus.FINISHED_STOPPED, stop_string)
            if stop is not None:
                self.scheduler.drop_output_tokens(req, rest)
                ended += self.scheduler.finish_requests(req.request_id, *stop)
            elif not rest:
                stream.send(req)
        self._end(ended)

    def _end(self, requests: list[Request]) -> None:
        """Final outputs of requests the scheduler ended. The gauges are refreshed before the requests leave
        ``_live``, so a caller that saw them end (``wait_idle``) reads fresh stats."""
        if not requests:
            return
        self._refresh_gauges()
        for req in requests:
            stream = self._streams.pop(req.request_id)
            del self._requests[req.request_id]
            if self.proposer is not None:
                self.proposer.forget(req.request_id)
            self._exports.pop(req.request_id, None)
            stream.flush()
            self.metrics.record_request(req.metrics, "error" if stream.error else req.status.value)
            with self._cv:
                self._live.discard(req.request_id)
                self._cv.notify_all()
            stream.send(req, final=True)

    @property
    def _num_waiting(self) -> int:
        """Requests queued in the scheduler, and those still waiting for their grammar."""
        return self.scheduler.num_waiting + len(self._compiling)

    def _refresh_gauges(self) -> None:
        self._kv_stats = self.kv.stats().as_dict()
        self.metrics.set_gauges(self.scheduler.num_running, self._num_waiting, self._kv_stats,
                                self.scheduler.class_counts())

    def _record_step(self, out: SchedulerOutput, sampled: int, step_time: float, engine_time: float,
                     mask_time: float | None) -> None:
        sched = self.scheduler
        self._kv_stats = self.kv.stats().as_dict()
        if mask_time is not None:
            self.metrics.observe("grammar_mask_time", mask_time)
        self.metrics.record_step(StepRecord(
            time=time.monotonic(), step_time=step_time, engine_time=engine_time, num_running=sched.num_running,
            num_waiting=self._num_waiting, num_preempted=len(out.preempted), batch_size=len(out.scheduled),
            prefill_tokens=out.num_prefill_tokens, decode_tokens=out.num_decode_tokens, sampled_tokens=sampled,
            kv_usage=self.kv.usage, prefix_hit_rate=self._kv_stats["hit_rate"]), self._kv_stats, sched.class_counts())
        if self.step_knobs is not None:
            self.step_knobs.observe(out.num_tokens, engine_time)
