"""Structured-output test cases shared by the runtime and serving tests: JSON schemas covering what the
issue lists (nested objects, arrays with min/max items, enums, bounded integers and numbers, strings with
maxLength/pattern, anyOf/oneOf, optional properties, additionalProperties false, $ref), regexes with
their Python equivalents, and the checks an output must pass (``json.loads`` + ``jsonschema``)."""

from __future__ import annotations

import json
import re

import jsonschema


def _obj(properties: dict, required=None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


_POINT = _obj({"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9,
                                                                            "maximum": 9}})
SCHEMAS: list[dict] = [
    _obj({"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
    _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}})}),
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 2, "maxItems": 5},
    {"enum": ["red", "green", "blue", 1, None]},
    {"type": "number", "minimum": -1.5, "maximum": 2.25},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4},
               {"type": "boolean"}]},
    _obj({"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 0, "maximum": 3}, "c": {"enum": ["x", "y"]}},
         required=[]),   # every property optional
    {"type": "boolean"},
    {"type": "null"},
    {"const": "fixed"},
    {"type": "array", "minItems": 1, "maxItems": 3,
     "items": _obj({"k": {"type": "string", "maxLength": 5}, "v": {"type": "number", "minimum": 0, "maximum": 100}})},
    {"type": "string", "minLength": 3, "maxLength": 8},
    {"$defs": {"point": _POINT}, **_obj({"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}})},
    {"oneOf": [_obj({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 10}}),
               _obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 10}})]},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b"]}],
     "items": False},
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    _obj({"a": _obj({"b": _obj({"c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}})})}),
    _obj({"list": {"type": "array", "items": {"type": "integer"}, "maxItems": 0},
          "note": {"type": "string", "maxLength": 3}}, required=["list"]),
    {"enum": ["café", "naïve", "東京"]},
    {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    _obj({"id": {"type": "integer", "minimum": 0, "maximum": 99},
          "status": {"enum": ["open", "closed"]},
          "score": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 10}, {"type": "null"}]}}),
]

# (xgrammar regex, the same as a Python regex for fullmatch)
REGEXES: list[tuple[str, str]] = [
    (r"[a-z]{3,8}@[a-z]{2,5}\.(com|org|net)", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org|net)"),
    (r"\d{4}-\d{2}-\d{2}", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    (r"\(\d{3}\) \d{3}-\d{4}", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    (r"#[0-9a-fA-F]{6}", r"#[0-9a-fA-F]{6}"),
    (r"(yes|no|maybe)( please)?", r"(yes|no|maybe)( please)?"),
    (r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}", r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}"),
]

CHOICES = ["alpha", "beta", "gamma delta", "ε"]

# an EBNF grammar (xgrammar's GBNF dialect) and the same language as a Python regex
GRAMMAR = 'root ::= "let " name " = " value ";"\nname ::= [a-z]{1,6}\nvalue ::= [0-9]{1,4} | "\\"" [a-z]{0,5} "\\""'
GRAMMAR_RE = r'let [a-z]{1,6} = ([0-9]{1,4}|"[a-z]{0,5}");'


def valid_json(text: str, schema: dict) -> bool:
    """Does ``text`` parse as JSON (control characters unescaped in strings are invalid JSON) and validate?"""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def fullmatch(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None


# ---- tools -------------------------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": _obj({"city": {"type": "string", "maxLength": 12},
                            "unit": {"enum": ["celsius", "fahrenheit"]}}, required=["city"])}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": _obj({"a": {"type": "integer", "minimum": -99, "maximum": 99},
                            "b": {"type": "integer", "minimum": -99, "maximum": 99}})}},
    {"type": "function", "function": {"name": "now", "description": "The time (no arguments)."}},
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
                for t in TOOLS}   # no parameters: no arguments

# A conversation with a tool round trip: the assistant called a tool, the tool answered.
TOOL_HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris, and 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
    {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    {"role": "user", "content": "And in Rome?"},
]

# Chat templates that render tools the way two families do (written for these tests, not the models' own
# files): Qwen 2.5's style (tools in the system turn, calls as <tool_call> JSON, results as <tool_response>
# in user turns) and Llama 3.1's JSON tool calling (tools in the first user turn, calls as
# {"name", "parameters"}, results in ipython turns).
QWEN_STYLE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call functions. Their signatures are within <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Write each call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA31_STYLE_TEMPLATE = """\
{{- bos_token }}<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>
{%- set ns = namespace(first_user=true) %}
{%- for message in messages %}
{%- if message.role == 'user' and tools and ns.first_user %}
{%- set ns.first_user = false %}<|start_header_id|>user<|end_header_id|>

Given these functions, answer with a JSON function call and its arguments.
Write it as {"name": function name, "parameters": dictionary of arguments}.

{% for tool in tools %}{{ tool | tojson }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- elif message.role != 'system' %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
