"""The bridge between HTTP handlers and ``LLM``: prompts checked against the engine, the runtime requests of
one HTTP request as one asyncio stream, backpressure, and aborts on disconnect or shutdown.

Backpressure counts *waiting* requests: runtime requests admitted by this server that have not produced
their first output yet (queued, or in prefill); each choice of an HTTP request (prompts x ``n``) is one. When
admitting a request's choices would put more than ``max_waiting`` of them waiting, the HTTP request is refused
(429) instead of queueing without bound; accepted requests are never dropped.

Prompts are checked by their size before they are tokenized (``kiln.serving.prompt_bounds``), and prompt work on
large inputs (parsing, chat templates, tokenizing) runs in ``ServingState.workers``, off the event loop.

Seeds: with ``n`` choices and a request seed ``s``, choice ``i`` samples with seed ``(s + i) mod 2**63``, so
choice 0 reproduces a single request with seed ``s`` and the whole set is reproducible.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from kiln.runtime import LLM, RequestOutput, SamplingParams
from kiln.runtime.outputs import RequestMetrics
from kiln.serving.openai.protocol import SEED_MAX, FieldError
from kiln.serving.prompt_bounds import PromptBounds, tokenize
from kiln.serving.prompt_workers import PromptWorkers

T = TypeVar("T")


class Overloaded(Exception):
    """Too many requests are waiting (429)."""


class ShuttingDown(Exception):
    """The server is draining or its step loop stopped (503)."""


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


class RuntimeRefused(FieldError):
    """A FieldError for a request the runtime refused at submission (it counted the rejection itself)."""


def choice_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else (seed + index) % (SEED_MAX + 1)


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_input_len: int
    max_seq_len: int
    max_batch_size: int
    bounds: PromptBounds

    @classmethod
    def of(cls, llm: LLM) -> EngineLimits:
        config = llm.engine.config
        return cls(config.model.vocab_size, config.bounds.max_input_len, config.bounds.max_seq_len,
                   int(llm.stats()["config"]["max_batch_size"]),
                   PromptBounds.of(llm.tokenizer, config.bounds.max_input_len))

    def check_text(self, text: str, param: str) -> None:
        """FieldError for a text prompt too large for the engine by its size alone (cheap: nothing tokenized)."""
        problem = self.bounds.text_problem(text)
        if problem is not None:
            raise FieldError(param, problem)

    def check_prompt(self, ids: list[int], param: str) -> None:
        """FieldError naming ``param`` for a prompt this engine can never take (its length first: cheap)."""
        if not ids:
            raise FieldError(param, "the prompt is empty (it has no tokens)")
        problem = self.bounds.ids_problem(len(ids))
        if problem is not None:
            raise FieldError(param, problem)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise FieldError(param, f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def check_max_tokens(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        if max_tokens is not None and num_prompt + max_tokens > self.max_seq_len:
            raise FieldError(param, f"the prompt ({num_prompt} tokens) + {param} ({max_tokens}) exceeds this "
                                    f"engine's max_seq_len {self.max_seq_len}; ask for at most "
                                    f"{max(self.max_seq_len - num_prompt, 0)} tokens")

    def check_choices(self, n: int, num_prompts: int, max_waiting: int) -> None:
        """FieldError for more choices than could ever run together: ``n`` beyond the batch, or a request whose
        choices alone exceed ``max_waiting`` (a 429 would only make the client retry it forever)."""
        if n > self.max_batch_size:
            raise FieldError("n", f"n={n} is more than this server's max_batch_size {self.max_batch_size} "
                                  "(the choices of a prompt run in one batch); lower n")
        if n * num_prompts > max_waiting:
            raise FieldError("n" if num_prompts == 1 else "prompt",
                             f"{num_prompts} prompt(s) x n={n} is {n * num_prompts} choices, more than this server "
                             f"admits at once (--max-waiting {max_waiting}); lower n or split the request")

    def encode(self, tokenizer, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``, its size checked first (run it in a worker when the text is long)."""
        self.check_text(text, param)
        return tokenize(tokenizer, text, add_special_tokens)


class TokenText:
    """Per-token strings for logprobs (cached: the same ids recur)."""

    def __init__(self, tokenizer):
        self._decode = functools.lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t], skip_special_tokens=False))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


class Inbox:
    """Hands runtime outputs from the step-loop thread to the event loop with one wake-up per burst: a step
    emits one output per running request, and waking the loop for each costs more than handling it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list[tuple[ChoiceStream, int, RequestOutput]] = []
        self.lock = threading.Lock()
        self.scheduled = False

    def put(self, stream: ChoiceStream, index: int, out: RequestOutput) -> None:   # any thread
        with self.lock:
            self.items.append((stream, index, out))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:   # the event loop is gone (server stopping): nobody is listening
            pass

    def _drain(self) -> None:   # event loop
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for stream, index, out in items:
            stream._arrived(index, out)


def max_json_values(limits: EngineLimits, max_waiting: int) -> int:
    """The most JSON values a request body this server can take holds (a larger one is refused before it is
    parsed): ``max_waiting`` prompts of ``max_input_len`` ids (the most choices admitted at once), or
    ``max_input_len`` chat messages (each renders at least one token) of up to 16 values, plus a ``logit_bias``
    entry per vocabulary token and 64k values of tools, schemas and other fields."""
    return max(max_waiting * (limits.max_input_len + 1), 16 * limits.max_input_len) + limits.vocab_size + (1 << 16)


class ServingState:
    """What the handlers share: the LLM, admission (backpressure, draining) and the open streams."""

    def __init__(self, llm: LLM, max_waiting: int, workers: PromptWorkers | None = None):
        self.llm = llm
        self.max_waiting = max_waiting
        self.limits = EngineLimits.of(llm)
        self.max_json_values = max_json_values(self.limits, max_waiting)
        self.workers = workers if workers is not None else PromptWorkers()
        self.rejected = 0   # requests this server refused before they reached the runtime (400, 413, 429)
        self.token_text = TokenText(llm.tokenizer) if llm.tokenizer is not None else None
        config = llm.stats()["config"]
        self.prefix_reuse, self.block_size = bool(config["enable_prefix_reuse"]), int(config["tokens_per_block"])
        self.accepting = True
        self.streams: set[ChoiceStream] = set()
        self._inboxes: dict[asyncio.AbstractEventLoop, Inbox] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def inbox(self) -> Inbox:
        loop = asyncio.get_running_loop()
        if loop not in self._inboxes:
            self._inboxes[loop] = Inbox(loop)
        return self._inboxes[loop]

    def num_waiting(self) -> int:
        return sum(len(s.waiting) for s in self.streams)

    def open_stream(self, choices: int = 1) -> ChoiceStream:
        """A stream for ``choices`` runtime requests; Overloaded if they would exceed ``max_waiting``."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down; send the request to another replica")
        failure = self.llm.executor.failure
        if failure is not None:
            raise ShuttingDown(f"the engine is not serving: {failure}")
        waiting = self.num_waiting()
        if waiting + choices > self.max_waiting:
            raise Overloaded(f"{waiting} requests are already waiting for their first token; this one's {choices} "
                             f"would exceed --max-waiting {self.max_waiting}; retry later")
        stream = ChoiceStream(self)
        self.streams.add(stream)
        self._idle.clear()
        return stream

    def _closed(self, stream: ChoiceStream) -> None:
        self.streams.discard(stream)
        if not self.streams:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no stream is open (within ``timeout`` seconds)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:   # not the builtin TimeoutError before Python 3.11
            return False

    def abort_all(self) -> None:
        for stream in list(self.streams):
            stream.abort()


class ChoiceStream:
    """The runtime requests behind one HTTP request (n per prompt) and their outputs, as one async stream
    of ``(choice index, RequestOutput)``. ``close`` aborts whatever has not finished.

    The n choices of a prompt share its KV blocks through the prefix cache, but only blocks already computed
    can be shared: choices submitted together would each prefill the whole prompt. So choice 0 goes first
    and the others follow when it produces its first output (one step later), when its prompt's full blocks
    are cached; they then prefill only the last, partial block.
    """

    def __init__(self, state: ServingState):
        self.state = state
        self.inbox = state.inbox()
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.request_ids: dict[int, str] = {}     # submitted choices
        self.num_choices = 0
        self.unfinished: set[int] = set()
        self.waiting: set[int] = set()
        self.deferred: dict[int, list[tuple[int, list[int], SamplingParams, int, str]]] = {}
        self.closed = False
        self.lora: str | None = None   # the LoRA adapter every choice runs with (the request's model), or None

    def add_prompt(self, prompt_ids: list[int], params: list[SamplingParams], priority: int, request_id: str) -> None:
        """Queue ``len(params)`` choices over one prompt (InvalidRequestError / ExecutorClosedError pass through)."""
        first = self.num_choices
        self.num_choices += len(params)
        choices = [(first + i, prompt_ids, sp, priority, f"{request_id}-{first + i}") for i, sp in enumerate(params)]
        for index, *_ in choices:
            self.unfinished.add(index)
            self.waiting.add(index)
        share = len(params) > 1 and self.state.prefix_reuse and len(prompt_ids) > self.state.block_size
        if share:
            self.deferred[first] = choices[1:]
            choices = choices[:1]
        for choice in choices:
            self._submit(*choice)

    def _submit(self, index: int, prompt_ids: list[int], params: SamplingParams, priority: int,
                request_id: str) -> None:
        self.state.llm.submit(prompt_ids, params, request_id=request_id, priority=priority,
                              callback=functools.partial(self.inbox.put, self, index), lora=self.lora)
        self.request_ids[index] = request_id

    def _submit_deferred(self, first: int) -> None:
        for index, ids, params, priority, request_id in self.deferred.pop(first, []):
            try:
                self._submit(index, ids, params, priority, request_id)
            except Exception as exc:   # the step loop stopped meanwhile: the choice fails like its sibling would
                self._arrived(index, RequestOutput(request_id, None, ids, [], "", "abort",
                                                   RequestMetrics(arrival_time=time.monotonic()), error=str(exc)))

    def _arrived(self, index: int, out: RequestOutput) -> None:
        self.waiting.discard(index)
        if out.finished:
            self.unfinished.discard(index)
        self.queue.put_nowait((index, out))
        if index in self.deferred and not self.closed:
            self._submit_deferred(index)

    @property
    def done(self) -> bool:
        return not self.unfinished and self.queue.empty()

    async def next_batch(self) -> list[tuple[int, RequestOutput]]:
        """Every output that has arrived (waiting for at least one): a slow reader gets merged deltas."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    async def finals(self) -> dict[int, RequestOutput]:
        """The final output of every choice."""
        out: dict[int, RequestOutput] = {}
        while len(out) < self.num_choices:
            for index, o in await self.next_batch():
                if o.finished:
                    out[index] = o
        return out

    def abort(self) -> None:
        for index in self.unfinished:
            if index in self.request_ids:
                self.state.llm.abort(self.request_ids[index])

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.deferred.clear()
            self.abort()
            self.state._closed(self)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled and ClientGone raised.
    (The body must have been read: afterwards the ASGI receive channel only reports the disconnect.)"""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone()


def created_now() -> int:
    return int(time.time())
