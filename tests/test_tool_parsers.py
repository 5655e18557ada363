"""Tool-call parsers without a server: what each family's text gives (content and calls), that any split of
the text into streamed deltas gives the same (property test), and the template-based detection."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.serving.openai.tool_parsers import (
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    NamedParser,
    detect_parser,
    json_end,
    parse_whole,
)

from structured_cases import LLAMA31_STYLE_TEMPLATE, QWEN_STYLE_TEMPLATE

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris \\"Ville\\"", "unit": "celsius"}}'
CASES = [   # (parser, text, content, [(name, arguments)])
    (HermesParser, f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
                   '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": 'Paris "Ville"', "unit": "celsius"}), ("add", {"a": 1, "b": 2})]),
    (HermesParser, "No tools needed: 4.", "No tools needed: 4.", []),
    (HermesParser, "<tool_call>\nnot json\n</tool_call> done", "<tool_call>\nnot json\n</tool_call> done", []),
    (HermesParser, f"<tool_call>{WEATHER}", "", [("get_weather", {"city": 'Paris "Ville"', "unit": "celsius"})]),
    (HermesParser, "a <tool_ b", "a <tool_ b", []),
    (Llama3JsonParser, '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                       '{"name": "now", "parameters": {}}', "", [("add", {"a": 1, "b": 2}), ("now", {})]),
    (Llama3JsonParser, ' {"name": "add", "parameters": "{\\"a\\": 3}"}', "", [("add", {"a": 3})]),
    (Llama3JsonParser, "It is {warm}.", "It is {warm}.", []),
    (Llama3JsonParser, '{"answer": 42}', '{"answer": 42}', []),
    (JsonArrayParser, '[{"name": "add", "parameters": {"a": 1, "b": [2, "]}"]}}, {"name": "now", "parameters": {}}]',
     "", [("add", {"a": 1, "b": [2, "]}"]}), ("now", {})]),
    (JsonArrayParser, '[{"name": "add", "param', '[{"name": "add", "param', []),
    (lambda: NamedParser("add"), '{"a": 5, "b": -1}', "", [("add", {"a": 5, "b": -1})]),
]


@pytest.mark.parametrize("make, text, content, calls", CASES)
def test_whole_answers(make, text, content, calls):
    got_content, got_calls = parse_whole(make(), text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls) and all(c.id.startswith("call_") for c in got_calls)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_streaming_split_gives_the_whole_answer(case, cuts):
    make, text, content, calls = case
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    parser, shown, pieces = make(), "", []
    for a, b in zip(bounds, bounds[1:]):
        c, p = parser.feed(text[a:b])
        shown, pieces = shown + c, pieces + p
    c, p = parser.finish()
    shown, pieces = shown + c, pieces + p
    assert shown == content
    merged: dict[int, list] = {}
    for piece in pieces:
        if piece.index not in merged:
            assert piece.id and piece.name
            merged[piece.index] = [piece.name, ""]
        else:
            assert piece.id is None and piece.name is None
        merged[piece.index][1] += piece.arguments
    assert [(n, json.loads(a)) for n, a in merged.values()] == calls


def test_json_end_skips_brackets_in_strings():
    text = '{"a": "}]{[", "b": [1, {"c": "\\"}"}]} tail'
    assert text[:json_end(text, 0)] == '{"a": "}]{[", "b": [1, {"c": "\\"}"}]}'
    assert json_end('{"a": [1, 2', 0) is None


def test_parser_detected_from_the_chat_template():
    assert detect_parser(QWEN_STYLE_TEMPLATE) == "hermes"
    assert detect_parser(LLAMA31_STYLE_TEMPLATE) == "llama3_json"
    assert detect_parser("{{ messages[0].content }}") is None and detect_parser(None) is None
