"""POST /v1/chat/completions: messages -> the engine's chat template -> a completion, whole or streamed."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.runtime import RequestOutput
from kiln.serving.chat_template import ChatTemplate, ChatTemplateError
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
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    FieldError,
    TokenLogprob,
    TopLogprob,
)

NO_TEMPLATE = ("this model has no chat template: the engine directory's tokenizer_config.json has no "
               "'chat_template'. Restart kiln serve with --chat-template FILE (a jinja2 template written for "
               "transformers' apply_chat_template), or use /v1/completions with a formatted prompt")


def chat_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, float]],
                  top: int) -> ChatLogprobs:
    def entry(t: int, v: float) -> TopLogprob:
        s = token_text(t)
        return TopLogprob(token=s, logprob=v, bytes=list(s.encode("utf-8")))

    content = []
    for t, lp in zip(token_ids, logprobs):
        chosen = entry(t, lp[t])
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=[entry(k, v) for k, v in best]))
    return ChatLogprobs(content=content)


def render_prompt(body: ChatCompletionRequest, state: ServingState, template: ChatTemplate | None) -> list[int]:
    if template is None:
        raise FieldError(None, NO_TEMPLATE)
    if state.llm.tokenizer is None:
        raise FieldError(None, "this engine directory has no tokenizer.json, so it cannot serve chat")
    try:
        text = template.render([m.model_dump() for m in body.messages], body.add_generation_prompt)
    except ChatTemplateError as exc:
        raise FieldError("messages", str(exc)) from None
    # the template writes the special tokens itself (as transformers' apply_chat_template(tokenize=True))
    return state.llm.tokenizer.encode(text, add_special_tokens=False).ids


async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: ServingState, model: str,
                                 fingerprint: str, template: ChatTemplate | None) -> Response:
    ids = render_prompt(body, state, template)
    max_tokens = body.effective_max_tokens
    state.limits.check_prompt(ids, "messages")
    state.limits.check_max_tokens(len(ids), max_tokens, body.max_tokens_field)
    top = (body.top_logprobs or 0) if body.logprobs else None
    request_id = new_id("chatcmpl")
    stream = submit_choices(state, request_id, [ids], choice_params(body, max_tokens, top), body.priority,
                            body.max_tokens_field)

    def logprobs_of(token_ids: list[int], logprobs: list) -> ChatLogprobs | None:
        return None if top is None else chat_logprobs(state.token_text, token_ids, logprobs, top)

    if not body.stream:
        finals = await wait_finals(request, stream)
        bad = failure_response(finals)
        if bad is not None:
            return bad
        choices = [ChatChoice(index=i, message=AssistantMessage(content=o.text), finish_reason=o.finish_reason,
                              logprobs=logprobs_of(o.token_ids, o.logprobs or []))
                   for i, o in enumerate(finals)]
        return JSONResponse(ChatCompletion(id=request_id, model=model, system_fingerprint=fingerprint,
                                           choices=choices, usage=usage([ids], finals)).model_dump())

    first = await first_batch_or_response(request, stream)
    if isinstance(first, Response):
        return first
    created = created_now()
    started: set[int] = set()

    def chunk(choices: list[ChatChunkChoice], use=None) -> str:
        return ChatCompletionChunk(id=request_id, created=created, model=model, system_fingerprint=fingerprint,
                                   choices=choices, usage=use).model_dump_json()

    def chunks(deltas: dict[int, ChoiceDelta]) -> list[str]:
        choices = []
        for i in sorted(deltas):
            d = deltas[i]
            if not (d.text or d.token_ids or d.final or i not in started):
                continue
            delta = ChatDelta(role=None if i in started else "assistant", content=d.text)
            started.add(i)
            choices.append(ChatChunkChoice(index=i, delta=delta, logprobs=logprobs_of(d.token_ids, d.logprobs),
                                           finish_reason=d.final.finish_reason if d.final else None))
        return [chunk(choices)] if choices else []

    def tail(finals: list[RequestOutput]) -> list[str]:
        if body.stream_options is None or not body.stream_options.include_usage:
            return []
        return [chunk([], usage([ids], finals))]

    return sse_stream(stream, first, chunks, tail)
