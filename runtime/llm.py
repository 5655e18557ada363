"""kiln.runtime.LLM: the Python API over an engine directory.

    llm = LLM("engines/llama", max_batch_size=16, capacity_policy="max_utilization")
    outs = llm.generate(["Hello", "The kiln"], SamplingParams(max_tokens=32, temperature=0))
    async for out in llm.generate_async("Hello", SamplingParams(max_tokens=32)): print(out.delta_text)
    for out in llm.stream("Hello", SamplingParams(max_tokens=32)): print(out.delta_text)

Options (ExecutorConfig): max_batch_size, max_num_tokens (at most the engine's), kv_cache_memory_fraction,
max_kv_cache_tokens, capacity_policy ("guaranteed_no_evict" default, or "max_utilization"),
enable_prefix_reuse, seed.

Errors (kiln's family, ``kiln.contract``): ``InvalidRequestError`` (a ValueError) for requests that can
never be served, ``ConfigError`` (a ValueError) for invalid SamplingParams or options,
``RequestFailedError`` (a RuntimeError) from ``generate`` when the engine failed on some of its requests'
steps (the LLM serves on), ``ExecutorClosedError`` (a RuntimeError) after ``shutdown``/``close`` or when the
step loop stopped (``llm.executor.failure`` says why).

LoRA adapters (an engine built with ``--lora-target-modules``): ``LLM(engine, lora_modules={"name": "path"},
max_loras=4)`` loads PEFT adapter directories; ``load_lora(name, path)`` / ``unload_lora(name)`` at any time;
``generate(prompts, params, lora="name" | [name or None per prompt])``, and ``lora=`` on ``submit``, ``stream``
and ``generate_async``. ``AdapterLoadError`` names what an adapter the engine cannot serve gets wrong.

Prompts: text, or token ids as a list/tuple of Python or numpy integers or a 1-D integer numpy array or torch
tensor, the same in every method (``kiln.runtime.prompts``); anything else is refused at submission.
Exiting the interpreter, or dropping the LLM, without ``shutdown()`` stops the step loop cleanly.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.contract import (
    ConfigError,
    EngineLoadError,
    ExecutorClosedError,
    InvalidRequestError,
    RequestFailedError,
    check_option_names,
    option_names,
)
from kiln.plugins.openmp_teams import on_own_thread
from kiln.runtime.detokenizer import load_tokenizer
from kiln.runtime.executor import Executor, ExecutorConfig
from kiln.runtime.memory import release_free_heap
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.prompts import Prompt, check_text, is_single_prompt, prompt_token_ids
from kiln.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kiln.runtime.engine import Engine


class LLM:
    def __init__(self, engine, tokenizer=None, *, config: ExecutorConfig | None = None,
                 lora_modules: dict[str, str | Path] | None = None, **options):
        """``engine``: an engine directory, or an already loaded ``Engine`` (shared, e.g. by tests; its owner
        closes it). Serving options: an ``ExecutorConfig`` as ``config``, or its fields as keywords.
        ``lora_modules``: LoRA adapters to load, name -> PEFT adapter directory.
        A tensor-parallel engine directory starts its other ranks (see ``kiln.runtime.tensor_parallel``)."""
        check_option_names(options, self.option_names(), type(self).__name__)
        if config is not None and options:
            raise ConfigError(f"give either config or its fields as keywords, not both ({sorted(options)})")
        config = config if config is not None else ExecutorConfig(**options)
        self._owns_engine = isinstance(engine, (str, Path))   # then shutdown() closes it (a TP engine's ranks)
        if self._owns_engine:
            from kiln.runtime.engine import Engine

            # the tokenizer first: its parse's transient heap (tens of MB) is released before the engine's
            # weights are resident (moved into huge pages at load), so the two never add up in the peak. One
            # that does not parse is named after the engine's load, whose checksums say whether it was damaged.
            unreadable = None
            try:
                self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(engine)
            except EngineLoadError as exc:
                self.tokenizer, unreadable = None, exc
            release_free_heap()
            engine = Engine.from_dir(engine)
            if unreadable is not None:
                engine.close()
                raise unreadable
        else:
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(engine.directory)
        self.engine = engine
        try:
            self.executor = Executor(engine, config, tokenizer=self.tokenizer)
            for name, path in (lora_modules or {}).items():
                self.load_lora(name, path)
        except BaseException:
            if hasattr(self, "executor"):
                self.executor.close()
            if self._owns_engine:
                engine.close()
            raise
        release_free_heap()   # what loading freed, before serving makes the process's resident peak
        # an LLM dropped without shutdown() still stops its loop (and its requests, and the other ranks of a
        # tensor-parallel engine it loaded) when collected
        weakref.finalize(self, _close, self.executor, engine if self._owns_engine else None).atexit = False

    @classmethod
    def option_names(cls) -> list[str]:
        """Every keyword this constructor takes: its own and ExecutorConfig's fields (what an unknown one is
        checked against)."""
        return ["tokenizer", "config", "lora_modules", *option_names(ExecutorConfig)]

    # ---- helpers --------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """(token ids, text) of a prompt: text is tokenized, token ids are checked and made plain ints
        (see ``kiln.runtime.prompts`` for the accepted forms); InvalidRequestError names what is wrong."""
        if isinstance(prompt, str):
            check_text(prompt)
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer; the engine directory has no tokenizer.json")
            return self.tokenizer.encode(prompt).ids, prompt
        return prompt_token_ids(prompt), None

    def _encode_request(self, prompt: Prompt) -> tuple[list[int], str | None]:
        try:
            return self.encode(prompt)
        except InvalidRequestError:
            self.executor.metrics.incr("requests_rejected")
            raise

    def _not_in_loop_thread(self, what: str) -> None:
        if self.executor.in_loop_thread():
            raise InvalidRequestError(f"{what}() cannot run in an output callback: it would wait for the step loop "
                                      "that is running the callback; use submit() there")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # ---- LoRA adapters --------------------------------------------------------------------------------
    def _adapters(self):
        if self.executor.adapters is None:
            raise ConfigError("this engine takes no LoRA adapters; rebuild it with --lora-target-modules (and "
                              "--max-lora-rank)")
        return self.executor.adapters

    def load_lora(self, name: str, path: str | Path) -> None:
        """Read the PEFT adapter directory ``path`` (off the step loop, which serves on) and serve it as ``name``;
        AdapterLoadError names what the engine cannot serve (rank, modules, shapes, files). The conversion's torch
        ops run on a thread that ends with them (kiln.plugins.openmp_teams): on the caller's thread (the server's
        worker threads live on) a real model's adapter would leave an OpenMP team behind."""
        on_own_thread(self._adapters().load, name, path, name="kiln-lora-load")

    def unload_lora(self, name: str) -> None:
        """Stop serving ``name``: new requests naming it are refused; those already running finish with it."""
        self._adapters().unload(name)

    def lora_names(self) -> list[str]:
        """The loaded adapters' names (empty for an engine without adapters)."""
        return [] if self.executor.adapters is None else self.executor.adapters.names()

    # ---- API ------------------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
               priority: int = 0, callback=None, lora: str | None = None) -> str:
        ids, text = self._encode_request(prompt)
        return self.executor.submit(ids, params, request_id=request_id, priority=priority, prompt=text,
                                    callback=callback, lora=lora)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: int | Sequence[int] = 0, timeout: float | None = None,
                 lora: str | None | Sequence[str | None] = None) -> list[RequestOutput]:
        """Run every prompt concurrently; the final RequestOutputs in input order.

        A prompt is a string or token ids (a list of ints, a 1-D integer array or tensor); a single prompt may
        be passed bare. ``lora``: one adapter name (or None) for all prompts, or one per prompt. Every request
        is checked before any is queued: if one is invalid, none runs and its InvalidRequestError
        (or ConfigError) is raised. On any exception while waiting (a timeout, Ctrl-C),
        this call's requests are aborted before it propagates. Requests the engine failed raise
        RequestFailedError (``outputs`` keeps every result); ExecutorClosedError if the step loop stopped.
        Its requests do not keep the decode pace (``tpot_target_s``): nobody reads their tokens before the call
        returns, so their steps take prompts whole (docs/benchmarks.md: what pacing them cost).
        """
        self._not_in_loop_thread("generate")
        try:
            single = is_single_prompt(prompts)
        except InvalidRequestError:
            self.executor.metrics.incr("requests_rejected")
            raise
        if single:
            prompts = [prompts]
        n = len(prompts)
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * n
        prios = list(priority) if isinstance(priority, (list, tuple)) else [priority] * n
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * n
        if len(params) != n or len(prios) != n or len(loras) != n:
            raise InvalidRequestError(f"{n} prompts but {len(params)} sampling params, {len(prios)} priorities and "
                                      f"{len(loras)} LoRA adapter names")
        encoded = [self._encode_request(p) for p in prompts]
        for (ids, _), sp, prio, name in zip(encoded, params, prios, loras):
            self.executor.validate(ids, sp, priority=prio, lora=name)
        results: list[RequestOutput | None] = [None] * n
        done = threading.Event()
        remaining = [n]
        lock = threading.Lock()

        def on_output(i):
            def cb(out: RequestOutput):
                if out.finished:
                    results[i] = out
                    with lock:
                        remaining[0] -= 1
                        if remaining[0] == 0:
                            done.set()
            return cb

        ids_submitted = []
        try:
            for i, ((ids, text), sp) in enumerate(zip(encoded, params)):
                ids_submitted.append(self.executor.submit(ids, sp, priority=prios[i], prompt=text,
                                                          callback=on_output(i), lora=loras[i], paced=False))
            if n and not done.wait(timeout):
                raise TimeoutError(f"generate did not finish within {timeout} s; its requests were aborted")
        except BaseException:   # KeyboardInterrupt included: nothing of this call is left running
            for rid in ids_submitted:
                self.executor.abort(rid)
            raise
        failed = [r for r in results if r is not None and r.error]
        if failed:
            if self.executor.failure is not None:
                raise ExecutorClosedError(failed[0].error)
            raise RequestFailedError(f"{len(failed)} of {n} requests failed: {failed[0].error}", results)
        return results

    async def generate_async(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                             request_id: str | None = None, priority: int = 0,
                             lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Incremental outputs of one request (each with ``delta_text`` / ``delta_token_ids``); the last one
        has ``finish_reason`` set. Closing or cancelling the iterator aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def cb(out: RequestOutput) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the consumer's event loop is gone (it stopped listening); nothing to deliver
                pass

        rid = self.submit(prompt, sampling_params, request_id=request_id, priority=priority, callback=cb, lora=lora)
        finished = False
        try:
            while True:
                out = await queue.get()
                if out.finished:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.executor.abort(rid)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
               request_id: str | None = None, priority: int = 0, lora: str | None = None) -> Iterator[RequestOutput]:
        """Blocking iterator of incremental outputs (the thread-based twin of ``generate_async``);
        leaving it early aborts the request."""
        self._not_in_loop_thread("stream")
        q: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        rid = self.submit(prompt, sampling_params, request_id=request_id, priority=priority, callback=q.put,
                          lora=lora)
        finished = False
        try:
            while not finished:
                out = q.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.executor.abort(rid)

    def abort(self, request_id: str) -> None:
        self.executor.abort(request_id)

    def stats(self) -> dict:
        """Counters, gauges, latency histograms (count/mean/p50/p90/p95/p99), recent step summary, KV cache."""
        return self.executor.stats()

    def metrics_summary(self) -> str:
        return self.executor.metrics.summary_text()

    def shutdown(self) -> None:
        """Stop the step loop (requests still running end with finish_reason "abort"); an engine this LLM
        loaded is closed too (a tensor-parallel engine stops its other ranks)."""
        self.executor.close()
        if self._owns_engine:
            self.engine.close()

    close = shutdown

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _close(executor: Executor, engine: Engine | None) -> None:
    executor.close(wait=False)
    if engine is not None:
        engine.close()
