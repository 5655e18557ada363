"""POST /v1/completions: prompts (text or token ids, one or many) -> completions, whole or streamed."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.runtime import InvalidRequestError, RequestOutput
from kiln.serving.openai.generation import ServingState, TokenText, created_now
from kiln.serving.openai.handlers import (
    ChoiceDelta,
    choice_params,
    failure_response,
    first_batch_or_response,
    new_id,
    sse_stream,
    submit_choices,
    usage,
    wait_finals,
)
from kiln.serving.openai.protocol import (
    MAX_CHOICES,
    MAX_PROMPTS,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FieldError,
)
from kiln.serving.openai.structured import check_constraint, request_constraint


def completion_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, float]], top: int,
                        offset: int) -> CompletionLogprobs:
    """OpenAI's legacy shape; ``text_offset`` counts characters from the start of the choice's text."""
    tokens = [token_text(t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[lp[t] for t, lp in zip(token_ids, logprobs)],
        top_logprobs=[{token_text(t): v for t, v in sorted(lp.items(), key=lambda kv: -kv[1])[:top]}
                      for lp in logprobs],
        text_offset=offsets)


def check_raw_completion(raw: dict, state: ServingState) -> None:
    """Before a large body is validated (its parsed JSON): a prompt list longer than any prompt or batch this
    engine takes is refused by its length, before its elements are validated one by one."""
    prompt = raw.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return
    bounds = state.limits.bounds
    if isinstance(prompt[0], int):   # one prompt of token ids
        if (problem := bounds.ids_problem(len(prompt))) is not None:
            raise FieldError("prompt", problem)
        return
    if len(prompt) > MAX_PROMPTS:
        raise FieldError("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
    for i, p in enumerate(prompt):
        if isinstance(p, list) and (problem := bounds.ids_problem(len(p))) is not None:
            raise FieldError(f"prompt[{i}]", problem)


def check_sizes(body: CompletionRequest, state: ServingState) -> int:
    """The cheap checks, before anything is tokenized: choices, and each prompt's size against the engine.
    Returns the size of the prompt work (characters of text, plus 4 per token id: about their JSON bytes)."""
    prompts, limits = body.prompts(), state.limits
    if len(prompts) * body.n > MAX_CHOICES:
        raise FieldError("n", f"{len(prompts)} prompts x n={body.n} is more than {MAX_CHOICES} choices; "
                              "split the request")
    limits.check_choices(body.n, len(prompts), state.max_waiting)
    size = 0
    for p in prompts:
        if isinstance(p, str):
            if state.llm.tokenizer is None:
                raise FieldError("prompt", "text prompts need a tokenizer; the engine directory has no tokenizer.json")
            limits.check_text(p, "prompt")
            size += len(p)
        else:
            if (problem := limits.bounds.ids_problem(len(p))) is not None:
                raise FieldError("prompt", problem)
            size += 4 * len(p)
    return size


def encode_prompts(body: CompletionRequest, state: ServingState) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids (checked against the engine) and text (for echo); the long part of a request."""
    llm, limits = state.llm, state.limits
    prompts, texts = [], []
    for p in body.prompts():
        if isinstance(p, str):
            ids, text = limits.encode(llm.tokenizer, p, "prompt"), p
        else:
            try:
                ids, text = llm.encode(p)
            except InvalidRequestError as exc:
                raise FieldError("prompt", str(exc)) from None
        limits.check_prompt(ids, "prompt")
        limits.check_max_tokens(len(ids), body.max_tokens, "max_tokens")
        prompts.append(ids)
        texts.append(text if text is not None else llm.decode(ids, skip_special_tokens=False))
    return prompts, texts


async def create_completion(body: CompletionRequest, request: Request, state: ServingState, model: str,
                            fingerprint: str, lora: str | None = None) -> Response:
    size = check_sizes(body, state)
    prompts, texts = await state.workers.run(encode_prompts, body, state, size=size)
    constraint = request_constraint(body, body.min_tokens)
    if constraint is not None:
        await check_constraint(state.llm, constraint)
    request_id = new_id("cmpl")
    stream = submit_choices(state, request_id, prompts,
                            choice_params(body, body.max_tokens, body.logprobs, constraint), body.priority,
                            "max_tokens", lora)
    n = body.n
    echo = [texts[i // n] if body.echo else "" for i in range(len(prompts) * n)]

    def logprobs_of(index: int, token_ids: list[int], logprobs: list, offset: int) -> CompletionLogprobs | None:
        if body.logprobs is None:
            return None
        return completion_logprobs(state.token_text, token_ids, logprobs, body.logprobs, offset)

    if not body.stream:
        finals = await wait_finals(request, stream)
        bad = failure_response(finals)
        if bad is not None:
            return bad
        choices = [CompletionChoice(index=i, text=echo[i] + o.text, finish_reason=o.finish_reason,
                                    logprobs=logprobs_of(i, o.token_ids, o.logprobs or [], 0))
                   for i, o in enumerate(finals)]
        return JSONResponse(Completion(id=request_id, model=model, system_fingerprint=fingerprint, choices=choices,
                                       usage=usage(prompts, finals)).model_dump())

    first = await first_batch_or_response(request, stream)
    if isinstance(first, Response):
        return first
    created = created_now()
    started: set[int] = set()
    offsets = [0] * len(echo)

    def chunk(choices: list[CompletionChoice], use=None) -> str:
        return Completion(id=request_id, created=created, model=model, system_fingerprint=fingerprint,
                          choices=choices, usage=use).model_dump_json()

    def chunks(deltas: dict[int, ChoiceDelta]) -> list[str]:
        choices = []
        for i in sorted(deltas):
            d = deltas[i]
            text = d.text if i in started else echo[i] + d.text
            if not (text or d.token_ids or d.final):
                continue
            started.add(i)
            lp = logprobs_of(i, d.token_ids, d.logprobs, offsets[i])
            offsets[i] += len(text)
            choices.append(CompletionChoice(index=i, text=text, logprobs=lp,
                                            finish_reason=d.final.finish_reason if d.final else None))
        return [chunk(choices)] if choices else []

    def tail(finals: list[RequestOutput]) -> list[str]:
        if body.stream_options is None or not body.stream_options.include_usage:
            return []
        return [chunk([], usage(prompts, finals))]

    return sse_stream(stream, first, chunks, tail)
