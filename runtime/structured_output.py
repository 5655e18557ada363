"""StructuredOutputParams: the shape a request's output must have (``SamplingParams.structured_output``).

Exactly one constraint per request: ``json`` (a JSON schema, dict or string), ``json_object`` (any JSON
object), ``regex`` (the whole output matches it), ``choice`` (the output is one of the strings),
``grammar`` (EBNF, xgrammar's GBNF dialect) or ``structural_tag`` (xgrammar's structural tag JSON, or
vLLM's legacy ``{"structures": [...], "triggers": [...]}``). Types are checked here (ConfigError, like every
SamplingParams field); whether a schema, regex or grammar is valid is decided where it is parsed, at
submission (``InvalidRequestError`` naming the problem), by ``kiln.runtime.grammar``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.contract import ConfigError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputParams:
    """One output constraint (see the module docstring). JSON is compact by default (a space after ``:`` and
    ``,``, none elsewhere): fewer tokens, and no runs of whitespace, which a grammar that allows any
    whitespace leaves a model free to write without end. ``any_whitespace=True`` allows any whitespace
    between JSON tokens (for models that pretty-print)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.check()

    @classmethod
    def of(cls, value: Any) -> StructuredOutputParams | None:
        """A StructuredOutputParams from itself, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f for f in cls.__dataclass_fields__})
            if unknown:
                raise ConfigError(f"structured_output has unknown keys {unknown}; it takes one of {list(KINDS)} "
                                  "(and any_whitespace)")
            return cls(**value)
        raise ConfigError("structured_output must be a StructuredOutputParams, a dict of its fields or None, "
                          f"got {type(value).__name__}")

    def check(self) -> None:
        problems = []
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            problems.append(f"give exactly one of {list(KINDS)}, got {given or 'none'}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (dict, str)):
                problems.append(f"{name} must be a dict or a JSON string, got {type(value).__name__}")
            elif isinstance(value, dict):
                try:
                    json.dumps(value)
                except (TypeError, ValueError) as exc:
                    problems.append(f"{name} is not JSON-serializable ({exc})")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                problems.append(f"{name} must be a non-empty string, got {value!r:.60}")
        if self.choice is not None:
            if not (isinstance(self.choice, (list, tuple)) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                problems.append(f"choice must be a non-empty list of non-empty strings, got {self.choice!r:.60}")
            else:
                self.choice = list(self.choice)
        for name in ("json_object", "any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be True or False, got {getattr(self, name)!r:.40}")
        if problems:
            raise ConfigError("invalid structured_output: " + "; ".join(problems))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as text: JSON (keys sorted) for dicts and choices, the string as given otherwise."""
        value = getattr(self, self.kind)
        if isinstance(value, bool):
            return ""
        if isinstance(value, (dict, list)):
            return json.dumps(value, sort_keys=True, ensure_ascii=False)
        return value

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """What determines the compiled grammar: (kind, text, any whitespace in JSON)."""
        return self.kind, self.text, self.any_whitespace and self.kind in ("json", "json_object", "structural_tag")
