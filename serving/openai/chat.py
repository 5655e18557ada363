"""POST /v1/chat/completions: messages -> the engine's chat template -> a completion, whole or streamed.

Tools: their definitions and the history's assistant ``tool_calls`` and ``tool`` messages go through the chat
template (as transformers' ``apply_chat_template(messages, tools=...)`` renders them, arguments as objects);
the answer's tool calls come out of its text with a parser (``tool_parsers``): the chat template family's
one for ``tool_choice="auto"``, the grammar's shape for ``"required"`` and a named function (whose output
``structured.py`` constrains). A choice with tool calls that stopped has ``finish_reason="tool_calls"``.
"""

from __future__ import annotations

import json

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
    FunctionCallDelta,
    FunctionCallOut,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
)
from kiln.serving.openai.structured import check_constraint, request_constraint
from kiln.serving.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    JsonArrayParser,
    NamedParser,
    ParsedToolCall,
    ToolCallPiece,
    ToolParser,
    make_parser,
    parse_whole,
)

TOOL_BYTES = 1024   # a tool definition's share of the prompt work, about its schema rendered as JSON
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


def template_messages(body: ChatCompletionRequest) -> list[dict]:
    """The messages as chat templates read them: tool call arguments as objects, not JSON text."""
    messages = []
    for m in body.messages:
        d = m.model_dump(exclude_none=True)
        for call in d.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        messages.append(d)
    return messages


def check_raw_chat(raw: dict, state: ServingState) -> None:
    """Before a large body is validated (its parsed JSON): more messages than the engine can take are refused by
    their number, before each is validated (see check_sizes)."""
    messages = raw.get("messages")
    if isinstance(messages, list):
        check_message_count(len(messages), state)


def check_message_count(count: int, state: ServingState) -> None:
    if count > state.limits.max_input_len:
        raise FieldError("messages", f"{count} messages cannot fit this engine's max_input_len "
                                     f"({state.limits.max_input_len} tokens); send fewer")


def check_sizes(body: ChatCompletionRequest, state: ServingState, template: ChatTemplate | None) -> int:
    """The cheap checks, before the template runs: choices, and the number of messages (each renders at least one
    token in any chat template, so more than max_input_len cannot fit). Returns the size of the prompt work."""
    if template is None:
        raise FieldError(None, NO_TEMPLATE)
    if state.llm.tokenizer is None:
        raise FieldError(None, "this engine directory has no tokenizer.json, so it cannot serve chat")
    limits = state.limits
    limits.check_choices(body.n, 1, state.max_waiting)
    check_message_count(len(body.messages), state)
    calls = sum(len(c.function.arguments) for m in body.messages for c in m.tool_calls or [])
    return sum(len(m.content or "") + 32 for m in body.messages) + calls + TOOL_BYTES * len(body.tools or [])


def render_prompt(body: ChatCompletionRequest, state: ServingState, template: ChatTemplate) -> list[int]:
    """The prompt's token ids: the template's text, its size checked, then tokenized (the long part)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        text = template.render(template_messages(body), body.add_generation_prompt, tools=tools)
    except ChatTemplateError as exc:
        raise FieldError("messages", str(exc)) from None
    # the template writes the special tokens itself (as transformers' apply_chat_template(tokenize=True))
    ids = state.limits.encode(state.llm.tokenizer, text, "messages", add_special_tokens=False)
    state.limits.check_prompt(ids, "messages")
    return ids


def tool_parser_factory(body: ChatCompletionRequest, family: str | None):
    """What makes each choice's tool-call parser (None: the request has no tools, or tool_choice "none")."""
    choice = body.tool_choice_name
    if choice == "none":
        return None
    if choice == "required":
        return JsonArrayParser
    if choice != "auto":
        return lambda: NamedParser(choice)
    if family is None:
        raise FieldError("tool_choice", "tool_choice 'auto' needs a tool-call parser, and none matches this "
                                        "model's chat template: restart kiln serve with --tool-call-parser "
                                        f"{'|'.join(TOOL_CALL_PARSERS)}, or send tool_choice 'required' or a "
                                        "named function (enforced by a grammar, whatever the template)")
    return lambda: make_parser(family)


def tool_calls_out(calls: list[ParsedToolCall]) -> list[ToolCallOut] | None:
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls] or None


def tool_call_deltas(pieces: list[ToolCallPiece]) -> list[ToolCallDelta] | None:
    return [ToolCallDelta(index=p.index, id=p.id, type="function" if p.id else None,
                          function=FunctionCallDelta(name=p.name, arguments=p.arguments)) for p in pieces] or None


def finish_reason(reason: str, parser: ToolParser | None) -> str:
    return "tool_calls" if reason == "stop" and parser is not None and parser.calls else reason


async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: ServingState, model: str,
                                 fingerprint: str, template: ChatTemplate | None,
                                 tool_call_parser: str | None = None, lora: str | None = None) -> Response:
    size = check_sizes(body, state, template)
    ids = await state.workers.run(render_prompt, body, state, template, size=size)
    max_tokens = body.effective_max_tokens
    state.limits.check_max_tokens(len(ids), max_tokens, body.max_tokens_field)
    top = (body.top_logprobs or 0) if body.logprobs else None
    new_parser = tool_parser_factory(body, tool_call_parser)
    constraint = request_constraint(body, body.min_tokens)
    if constraint is not None:
        await check_constraint(state.llm, constraint)
    request_id = new_id("chatcmpl")
    stream = submit_choices(state, request_id, [ids], choice_params(body, max_tokens, top, constraint), body.priority,
                            body.max_tokens_field, lora)

    def logprobs_of(token_ids: list[int], logprobs: list) -> ChatLogprobs | None:
        return None if top is None else chat_logprobs(state.token_text, token_ids, logprobs, top)

    if not body.stream:
        finals = await wait_finals(request, stream)
        bad = failure_response(finals)
        if bad is not None:
            return bad
        choices = []
        for i, o in enumerate(finals):
            parser = new_parser() if new_parser else None
            content, calls = parse_whole(parser, o.text) if parser else (o.text, [])
            message = AssistantMessage(content=content or (None if calls else ""), tool_calls=tool_calls_out(calls))
            choices.append(ChatChoice(index=i, message=message, finish_reason=finish_reason(o.finish_reason, parser),
                                      logprobs=logprobs_of(o.token_ids, o.logprobs or [])))
        return JSONResponse(ChatCompletion(id=request_id, model=model, system_fingerprint=fingerprint,
                                           choices=choices, usage=usage([ids], finals)).model_dump())

    first = await first_batch_or_response(request, stream)
    if isinstance(first, Response):
        return first
    created = created_now()
    started: set[int] = set()
    parsers: dict[int, ToolParser] = {}

    def chunk(choices: list[ChatChunkChoice], use=None) -> str:
        return ChatCompletionChunk(id=request_id, created=created, model=model, system_fingerprint=fingerprint,
                                   choices=choices, usage=use).model_dump_json()

    def split(i: int, d: ChoiceDelta) -> tuple[str, list[ToolCallPiece], ToolParser | None]:
        """The delta's content and tool-call pieces (all content without tools)."""
        if new_parser is None:
            return d.text, [], None
        parser = parsers.setdefault(i, new_parser())
        content, pieces = parser.feed(d.text)
        if d.final:
            rest, more = parser.finish()
            content, pieces = content + rest, pieces + more
        return content, pieces, parser

    def chunks(deltas: dict[int, ChoiceDelta]) -> list[str]:
        choices = []
        for i in sorted(deltas):
            d = deltas[i]
            content, pieces, parser = split(i, d)
            if not (content or pieces or d.token_ids or d.final or i not in started):
                continue
            delta = ChatDelta(role=None if i in started else "assistant", content=None if pieces and not content
                              else content, tool_calls=tool_call_deltas(pieces))
            started.add(i)
            choices.append(ChatChunkChoice(index=i, delta=delta, logprobs=logprobs_of(d.token_ids, d.logprobs),
                                           finish_reason=finish_reason(d.final.finish_reason, parser) if d.final
                                           else None))
        return [chunk(choices)] if choices else []

    def tail(finals: list[RequestOutput]) -> list[str]:
        if body.stream_options is None or not body.stream_options.include_usage:
            return []
        return [chunk([], usage([ids], finals))]

    return sse_stream(stream, first, chunks, tail)
