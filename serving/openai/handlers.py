"""What the completion and chat endpoints share: submitting the choices of a request, waiting for them
(aborting on disconnect), merging streamed outputs per choice, usage, and failure statuses."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse

from kiln.runtime import ExecutorClosedError, InvalidRequestError, RequestOutput, SamplingParams
from kiln.serving.openai.generation import (
    ChoiceStream,
    RuntimeRefused,
    ServingState,
    ShuttingDown,
    choice_seed,
    until_disconnect,
)
from kiln.serving.openai.protocol import FieldError, SamplingFields, Usage
from kiln.serving.openai.responses import SSEResponse, error_response, sse_error, sse_event
from kiln.serving.openai.structured import Constraint


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def choice_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                  constraint: Constraint | None = None, **overrides) -> list[SamplingParams]:
    kwargs = {**body.sampling_kwargs(max_tokens), **overrides}
    structured = None if constraint is None else constraint.spec
    return [SamplingParams(**kwargs, seed=choice_seed(body.seed, i), logprobs=logprobs, structured_output=structured)
            for i in range(body.n)]


def submit_choices(state: ServingState, request_id: str, prompts: list[list[int]], params: list[SamplingParams],
                   priority: int, max_tokens_param: str, lora: str | None = None) -> ChoiceStream:
    """Open a stream with ``len(params)`` choices per prompt (choice index = prompt index * n + i), each on the
    LoRA adapter ``lora`` (None: the base model)."""
    if params[0].stop and state.llm.tokenizer is None:
        raise FieldError("stop", "stop strings need a tokenizer; this engine directory has no tokenizer.json")
    stream = state.open_stream(len(prompts) * len(params))
    stream.lora = lora
    try:
        for ids in prompts:
            stream.add_prompt(ids, params, priority, request_id)
    except InvalidRequestError as exc:   # the bounds left after the prompt checks: max_tokens vs the pool
        stream.close()
        raise RuntimeRefused(max_tokens_param, str(exc)) from None
    except ExecutorClosedError as exc:
        stream.close()
        raise ShuttingDown(str(exc)) from None
    except BaseException:
        stream.close()
        raise
    return stream


def failure_response(outputs: list[RequestOutput]) -> JSONResponse | None:
    """500 when the step loop failed a request, 503 when the server aborted it at shutdown; else None."""
    for out in outputs:
        if out.error:
            return error_response(500, f"the engine failed while serving this request: {out.error}")
    if any(out.finish_reason == "abort" for out in outputs):
        return error_response(503, "the server is shutting down; the request was aborted before it finished")
    return None


def failure_event(out: RequestOutput) -> str | None:
    if out.error:
        return sse_error(500, f"the engine failed while serving this request: {out.error}")
    if out.finish_reason == "abort":
        return sse_error(503, "the server is shutting down; the request was aborted before it finished")
    return None


def usage(prompts: list[list[int]], finals: list[RequestOutput]) -> Usage:
    """Each prompt counts once (as OpenAI counts it for n > 1); every choice's tokens count."""
    p = sum(len(ids) for ids in prompts)
    c = sum(len(o.token_ids) for o in finals)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


async def wait_finals(request: Request, stream: ChoiceStream) -> list[RequestOutput]:
    """Every choice's final output in index order (ClientGone if the client left: its requests are aborted)."""
    try:
        finals = await until_disconnect(request, stream.finals())
    finally:
        stream.close()
    return [finals[i] for i in sorted(finals)]


@dataclass
class ChoiceDelta:
    """What one choice gained since the last chunk (merged over every output that arrived)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    final: RequestOutput | None = None


class DeltaMerger:
    def __init__(self, num_choices: int):
        self.sent_tokens = [0] * num_choices
        self.finals: dict[int, RequestOutput] = {}

    def merge(self, batch: list[tuple[int, RequestOutput]]) -> dict[int, ChoiceDelta]:
        deltas: dict[int, ChoiceDelta] = {}
        last: dict[int, RequestOutput] = {}
        for index, out in batch:
            deltas.setdefault(index, ChoiceDelta()).text += out.delta_text
            last[index] = out
        for index, out in last.items():
            d, start = deltas[index], self.sent_tokens[index]
            d.token_ids = out.token_ids[start:]
            d.logprobs = out.logprobs[start:] if out.logprobs is not None else []
            self.sent_tokens[index] = len(out.token_ids)
            if out.finished:
                d.final = self.finals[index] = out
        return deltas


async def first_batch_or_response(request: Request, stream: ChoiceStream):
    """The first outputs of a streamed request, before any header is sent (so that a failure can still be
    a status code); a Response instead if it failed or the client left."""
    try:
        batch = await until_disconnect(request, stream.next_batch())
    except BaseException:
        stream.close()
        raise
    bad = failure_response([o for _, o in batch if o.finished])
    if bad is not None:
        stream.close()
        return bad
    return batch


def sse_stream(stream: ChoiceStream, first: list[tuple[int, RequestOutput]],
               chunks: Callable[[dict[int, ChoiceDelta]], list[str]], tail: Callable[[list[RequestOutput]], list[str]]
               ) -> SSEResponse:
    """Stream ``chunks(deltas)`` for each merged batch, then ``tail(finals)`` and ``[DONE]``; a failure after the
    headers becomes an error event."""
    merger = DeltaMerger(stream.num_choices)

    async def events() -> AsyncIterator[str]:
        batch = first
        while True:
            deltas = merger.merge(batch)
            failed = next((e for d in deltas.values() if d.final and (e := failure_event(d.final))), None)
            if failed:
                yield failed
                break
            for payload in chunks(deltas):
                yield sse_event(payload)
            if stream.done:
                for payload in tail([merger.finals[i] for i in sorted(merger.finals)]):
                    yield sse_event(payload)
                break
            batch = await stream.next_batch()
        yield "data: [DONE]\n\n"

    return SSEResponse(events(), on_close=stream.close)
