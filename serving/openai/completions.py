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


async def create_completion(body: CompletionRequest, request: Request, state: ServingState, model: str,
                            fingerprint: str, lora: str | None = None) -> Response:
    llm, limits = state.llm, state.limits
    if len(body.prompts()) * body.n > MAX_CHOICES:
        raise FieldError("n", f"{len(body.prompts())} prompts x n={body.n} is more than {MAX_CHOICES} choices; "
                              "split the request")
    prompts, texts = [], []
    for p in body.prompts():
        try:
            ids, text = llm.encode(p)
        except InvalidRequestError as exc:   # a text prompt and no tokenizer
            raise FieldError("prompt", str(exc)) from None
        limits.check_prompt(ids, "prompt")
        limits.check_max_tokens(len(ids), body.max_tokens, "max_tokens")
        prompts.append(ids)
        texts.append(text if text is not None else llm.decode(ids, skip_special_tokens=False))
    constraint = request_constraint(body, body.min_tokens)
    if constraint is not None:
        await check_constraint(llm, constraint)
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
