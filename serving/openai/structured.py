"""Structured output at the OpenAI boundary: the request fields that constrain an output become the
runtime's one ``StructuredOutputParams``, with the name of the field that asked (a 400 names it).

The fields: ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` and older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and on chat ``tool_choice``
``"required"`` (a JSON array of calls, each ``{"name", "parameters"}`` valid for one of the tools) or a
named function (its parameters' schema). At most one of them per request. The constraint is parsed, and
its compile started, in a worker thread (a large schema takes milliseconds, which the event loop serving
every other stream should not wait), so an invalid one is refused before anything is queued.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from kiln.runtime import ConfigError, InvalidRequestError
from kiln.runtime.structured_output import StructuredOutputParams
from kiln.serving.openai.protocol import FieldError, StructuredOutputFields

STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}   # a function without parameters


@dataclass(frozen=True)
class Constraint:
    spec: StructuredOutputParams
    param: str   # the request field it came from


def _structured_outputs(body: StructuredOutputFields) -> tuple[str, dict] | None:
    so = body.structured_outputs
    if so is None:
        return None
    given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar),
                               ("json_object", so.json_object), ("structural_tag", so.structural_tag))
             if v not in (None, False)}
    if len(given) != 1:
        raise FieldError("structured_outputs", f"give exactly one of {list(STRUCTURED_OUTPUTS_KINDS)}, got "
                                               f"{sorted(given) or 'none'}")
    ((kind, value),) = given.items()
    return f"structured_outputs.{kind}", {kind: value, "any_whitespace": so.disable_any_whitespace is False}


def tool_call_constraint(body) -> tuple[str, dict] | None:
    """The grammar of a forced tool call: ``tool_choice="required"`` or a named function (None otherwise)."""
    choice = body.tool_choice_name if body.tools else "none"
    if choice in ("none", "auto"):
        return None
    functions = [t.function for t in body.tools]
    if choice != "required":
        i, f = next((i, f) for i, f in enumerate(functions) if f.name == choice)
        return f"tools[{i}].function.parameters", {"json": f.parameters or NO_ARGUMENTS}
    calls = [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters or NO_ARGUMENTS},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not body.parallel_tool_calls:
        array["maxItems"] = 1
    return "tools", {"json": array}


def request_constraint(body: StructuredOutputFields, min_tokens: int = 0) -> Constraint | None:
    """The one constraint a request asks for, or None; FieldError when it asks for several or is malformed."""
    found: list[tuple[str, dict]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise FieldError("response_format.json_schema", "response_format of type json_schema needs json_schema")
        schema = rf.json_schema.schema_
        found.append(("response_format.json_schema.schema", {"json": schema} if schema is not None
                      else {"json_object": True}))
    elif rf is not None and rf.json_schema is not None:
        raise FieldError("response_format.json_schema", "json_schema is only allowed with type json_schema")
    if (so := _structured_outputs(body)) is not None:
        found.append(so)
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value: Any = getattr(body, name)
        if value is not None:
            found.append((name, {kind: value}))
    if (tool := tool_call_constraint(body) if hasattr(body, "tools") else None) is not None:
        found.append(tool)
    if not found:
        return None
    if len(found) > 1:
        raise FieldError(found[1][0], f"{found[0][0].split('.')[0]} and {found[1][0].split('.')[0]} both constrain the "
                                      "output; give one of them")
    param, fields = found[0]
    if min_tokens:
        raise FieldError("min_tokens", f"min_tokens cannot be combined with {param.split('.')[0]}: the grammar decides "
                                       "where the output may end")
    try:
        return Constraint(StructuredOutputParams(**fields), param)
    except ConfigError as exc:
        raise FieldError(param, str(exc).removeprefix("invalid structured_output: ")) from None


async def check_constraint(llm, constraint: Constraint) -> None:
    """Parse the constraint and start compiling it, in a worker thread; FieldError (400) naming its field
    if it is invalid (or the server cannot do structured output: no xgrammar, no tokenizer)."""
    def prepare() -> None:
        llm.executor.grammar_compiler().prepare(constraint.spec)

    try:
        await asyncio.to_thread(prepare)
    except InvalidRequestError as exc:
        raise FieldError(constraint.param, str(exc)) from None
