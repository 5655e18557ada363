"""Structured output and tool calling through `kiln serve` with the official `openai` client, on two servers:
a Llama checkpoint (byte-level BPE) with a Qwen-style chat template that renders tools (its tool calls are
parsed by the hermes parser) and a Mistral checkpoint (SentencePiece-style) with a Llama-3.1-style one
(llama3_json). Every finished output must validate; tool prompts must be rendered as transformers renders
them; streamed tool calls and content must add up to the whole answer; bad constraints get a 400 naming
the field."""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import openai
import pytest

from kiln.runtime import LLM, SamplingParams
from kiln.serving.openai.chat import tool_parser_factory
from kiln.serving.openai.protocol import ChatCompletionRequest, FieldError

from runtime_support import get_engine
from structured_cases import (
    CHOICES,
    GRAMMAR,
    GRAMMAR_RE,
    LLAMA31_STYLE_TEMPLATE,
    QWEN_STYLE_TEMPLATE,
    REGEXES,
    SCHEMAS,
    TOOL_HISTORY,
    TOOL_SCHEMAS,
    TOOLS,
    fullmatch,
    valid_json,
)
from test_serving_openai import API_KEY, MODEL, start_server

pytestmark = [pytest.mark.xdist_group("structured"), pytest.mark.usefixtures("hang_watchdog")]
pytest.importorskip("xgrammar")

# tool definitions make long prompts: a larger engine than the other tests' (the model is as tiny)
BUILD = dict(max_input_len=1536, max_seq_len=2048, max_num_tokens=256)
SERVERS = {"hermes": ("llama", {}, QWEN_STYLE_TEMPLATE), "llama3_json": ("mistral", {"tokenizer": "sentencepiece"},
                                                                         LLAMA31_STYLE_TEMPLATE)}


@pytest.fixture(scope="module")
def setups(checkpoint_dir, tmp_path_factory):
    """Per parser family: (server, in-process reference LLM on the same engine, HF tokenizer, template)."""
    from transformers import AutoTokenizer

    out = {}
    try:
        for family, (model_family, kw, template) in SERVERS.items():
            ckpt = checkpoint_dir(model_family, **kw)
            engine = get_engine(ckpt, **BUILD)
            folder = tmp_path_factory.mktemp(f"serve-{family}")
            (folder / "template.jinja").write_text(template)
            server = start_server(engine.directory, folder / "server.log", "--chat-template",
                                  str(folder / "template.jinja"))
            out[family] = (server, LLM(engine), AutoTokenizer.from_pretrained(ckpt), template)
        yield out
    finally:
        for server, ref, *_ in out.values():
            server.stop()
            ref.shutdown()
            assert server.proc.returncode == 0, server.log.read_text()[-3000:]


@pytest.fixture(scope="module", params=list(SERVERS))
def family(request):
    return request.param


@pytest.fixture
def setup(setups, family):
    return setups[family]


@pytest.fixture
def client(setup):
    with openai.OpenAI(base_url=f"{setup[0].url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def chat(client, messages=None, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages or [{"role": "user", "content": "Hi"}],
                                          **kw)


# ---- response_format, structured_outputs, guided_* -----------------------------------------------------------
def test_every_schema_through_response_format_validates(setup):
    server = setup[0]

    async def one(ac, i, schema):
        r = await ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Give me JSON number {i}"}], max_tokens=80,
            temperature=1.0, seed=i, response_format={"type": "json_schema", "json_schema": {
                "name": f"schema_{i}", "schema": schema, "strict": True}})
        return r.choices[0]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i, s) for i, s in enumerate(SCHEMAS)))

    choices = asyncio.run(run())
    stopped = [(s, c) for s, c in zip(SCHEMAS, choices) if c.finish_reason == "stop"]
    assert len(stopped) >= 0.95 * len(SCHEMAS), [c.message.content for c in choices if c.finish_reason != "stop"]
    assert all(valid_json(c.message.content, s) for s, c in stopped), [(s, c.message.content) for s, c in stopped]


def test_json_object_n_choices_and_completions(client):
    r = chat(client, max_tokens=80, n=3, seed=4, temperature=1.0, response_format={"type": "json_object"})
    stopped = [c for c in r.choices if c.finish_reason == "stop"]
    assert all(isinstance(json.loads(c.message.content), dict) for c in stopped)
    schema = SCHEMAS[0]
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=60, n=3, seed=1, temperature=1.0,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "person", "schema": schema}}})
    assert all(c.finish_reason == "stop" and valid_json(c.text, schema) for c in r.choices)
    assert len({c.text for c in r.choices}) > 1


@pytest.mark.parametrize("fields, check", [
    ({"structured_outputs": {"regex": REGEXES[0][0]}}, lambda t: fullmatch(REGEXES[0][1], t)),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    ({"structured_outputs": {"grammar": GRAMMAR}}, lambda t: fullmatch(GRAMMAR_RE, t)),
    ({"structured_outputs": {"json": SCHEMAS[2], "disable_any_whitespace": True}},
     lambda t: valid_json(t, SCHEMAS[2])),
    ({"guided_json": json.dumps(SCHEMAS[1])}, lambda t: valid_json(t, SCHEMAS[1])),
    ({"guided_regex": REGEXES[1][0]}, lambda t: fullmatch(REGEXES[1][1], t)),
    ({"guided_choice": ["north", "south"]}, lambda t: t in ("north", "south")),
    ({"guided_grammar": GRAMMAR}, lambda t: fullmatch(GRAMMAR_RE, t)),
])
def test_vllm_structured_outputs_and_guided_fields(client, fields, check):
    r = chat(client, max_tokens=60, temperature=1.0, seed=3, extra_body=fields)
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].message.content), r.choices[0].message.content
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=60, temperature=0, extra_body=fields)
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), r.choices[0].text


def test_streamed_constrained_output_concatenates_to_a_valid_document(client):
    schema = SCHEMAS[12]
    kw = dict(max_tokens=80, temperature=1.0, seed=9, response_format={"type": "json_schema", "json_schema": {
        "name": "items", "schema": schema}})
    whole = chat(client, **kw).choices[0]
    text, finish = "", None
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert (text, finish) == (whole.message.content, whole.finish_reason) and valid_json(text, schema)


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}},
     "response_format.json_schema.schema", "'uniqueItems' at #"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "response_format.type"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex", "invalid regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "give exactly one of"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar", "invalid EBNF"),
    ({"guided_json": "{no", "max_tokens": 5}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "both constrain"),
    ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens", "cannot be combined"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be 'none', 'auto', 'required' or"),
    ({"guided_json": 5}, "guided_json", "must be a JSON object, or its JSON text"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools", "invalid JSON schema"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tools", "both constrain"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", "content is required"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages[0].tool_call_id", "needs the tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{x"}}]}]}, "messages[0].tool_calls[0].function.arguments", "must be JSON text"),
])
def test_bad_constraints_and_tools_get_400_naming_the_field(setup, fields, param, message):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, **fields}
    r = httpx.post(f"{setup[0].url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_auto_needs_a_parser_and_none_renders_no_call():
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    with pytest.raises(FieldError, match="--tool-call-parser hermes|llama3_json") as e:
        tool_parser_factory(body, None)
    assert e.value.param == "tool_choice"
    none = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                 "tool_choice": "none"})
    assert tool_parser_factory(none, None) is None


# ---- tools ------------------------------------------------------------------------------------------------
def check_calls(calls, only: str | None = None) -> None:
    assert calls and len({c.id for c in calls}) == len(calls)
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and (only is None or c.function.name == only)
        assert valid_json(c.function.arguments, TOOL_SCHEMAS[c.function.name]), c.function.arguments


def test_required_and_named_tool_choice_give_valid_arguments(client):
    for seed in range(3):
        r = chat(client, max_tokens=400, temperature=1.0, seed=seed, tools=TOOLS, tool_choice="required")
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        check_calls(c.message.tool_calls)
    r = chat(client, max_tokens=400, temperature=1.0, seed=5, tools=TOOLS, tool_choice="required",
             parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1
    for name in TOOL_SCHEMAS:
        r = chat(client, max_tokens=60, temperature=1.0, seed=1, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": name}})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        check_calls(c.message.tool_calls, only=name)


def stream_tool_calls(client, **kw):
    """(content, {index: (id, name, arguments)}, finish_reason) from a streamed answer, as a client adds it up."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                if t.index not in calls:
                    assert t.id and t.function.name, "the first piece of a call has its id and name"
                    calls[t.index] = [t.id, t.function.name, ""]
                else:
                    assert t.id is None
                calls[t.index][2] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_streamed_tool_calls_add_up_to_the_whole_answer(client, tool_choice):
    kw = dict(max_tokens=400, temperature=1.0, seed=2, tools=TOOLS, tool_choice=tool_choice)
    whole = chat(client, **kw).choices[0]
    content, calls, finish = stream_tool_calls(client, **kw)
    assert finish == whole.finish_reason == "tool_calls" and content == ""
    assert [(name, args) for _, name, args in calls.values()] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    check_calls(whole.message.tool_calls)


FORMATS = {   # what each family's model writes for a call (forced here with a regex: the model is random)
    "hermes": r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}"\}\}\n</tool_call>',
    "llama3_json": r'\{"name": "get_weather", "parameters": \{"city": "[a-z]{1,8}"\}\}',
}


def test_auto_tool_calls_are_parsed_from_the_family_format(client, family):
    kw = dict(max_tokens=80, temperature=1.0, seed=4, tools=TOOLS, tool_choice="auto",
              extra_body={"structured_outputs": {"regex": FORMATS[family]}})
    c = chat(client, **kw).choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content == ("Sure." if family == "hermes" else None)
    check_calls(c.message.tool_calls, only="get_weather")
    content, calls, finish = stream_tool_calls(client, **kw)
    assert finish == "tool_calls" and content == (c.message.content or "")
    assert [(n, a) for _, n, a in calls.values()] == [("get_weather", c.message.tool_calls[0].function.arguments)]
    # unconstrained, the random model writes text: no call, the text is the content
    r = chat(client, max_tokens=20, temperature=0, tools=TOOLS).choices[0]
    assert r.finish_reason in ("stop", "length") and r.message.tool_calls is None and r.message.content


def test_tool_history_renders_like_transformers(setup, client):
    """Tools, assistant tool_calls and tool results through the template: the same prompt as transformers'
    apply_chat_template (so the same greedy answer as the reference LLM on those token ids)."""
    _, ref, hf_tokenizer, template = setup
    hf_messages = copy.deepcopy(TOOL_HISTORY)
    for m in hf_messages:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    ids = hf_tokenizer.apply_chat_template(hf_messages, tools=TOOLS, chat_template=template, add_generation_prompt=True,
                                           tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    (want,) = ref.generate([ids], SamplingParams(temperature=0, max_tokens=12))
    r = chat(client, TOOL_HISTORY, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == want.text and r.choices[0].message.tool_calls is None


def test_metrics_count_structured_requests(setup, client):
    def scrape() -> dict[str, float]:
        return setup[0].metrics()

    before = scrape()
    chat(client, max_tokens=20, extra_body={"guided_regex": "[0-9]{4}"})
    after = scrape()
    for name in ("kiln_structured_output_requests_total", "kiln_grammar_compile_time_seconds_count",
                 "kiln_grammar_mask_time_seconds_count", "kiln_grammar_cache_hits_total",
                 "kiln_grammar_cache_misses_total"):
        assert name in after, name
    assert after["kiln_structured_output_requests_total"] == before["kiln_structured_output_requests_total"] + 1
    assert after["kiln_grammar_mask_time_seconds_count"] > before["kiln_grammar_mask_time_seconds_count"]
