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
