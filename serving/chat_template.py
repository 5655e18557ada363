"""Chat templates, rendered the way Hugging Face ``transformers`` renders them (``apply_chat_template``).

A checkpoint's ``tokenizer_config.json`` carries its ``chat_template`` (a jinja2 template, or a list of
named ones) and its special tokens; the builder copies that file into the engine directory. Templates come
from model repositories, so they run in jinja2's immutable sandbox, in the environment transformers gives
them: ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, ``{% generation %}`` blocks, a
``tojson`` filter that does not escape HTML, ``raise_exception``, ``strftime_now``, a ``namespace`` that
refuses underscore names, and the variables ``messages``, ``add_generation_prompt``, ``tools``, ``documents``
plus every special token (``bos_token``, ``eos_token``, ...). Messages lose their ``None`` fields first, as
transformers does, because templates test for a key's presence.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the messages (``raise_exception``) or failed on them; the message says how."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed names (no reaching CPython internals through it)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed names ({name!r})")


class _TemplateDict:
    """``dict(...)`` / ``dict.fromkeys(...)`` without the attributes of the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it; rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template and the special tokens it sees."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc.message} (line {exc.lineno})") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text for ``messages`` (dicts with "role", "content", ...); ChatTemplateError if the
        template refuses them."""
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context = {**self.special_tokens, "tools": None, "documents": None, **variables}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed on the messages ({type(exc).__name__}: {exc})") from None


def load_chat_template(engine_dir: str | Path, template_file: str | Path | None = None) -> ChatTemplate | None:
    """The chat template for an engine: ``template_file`` (a jinja2 file) if given, else the one in the engine
    directory's tokenizer_config.json (the "default" one of a list of named templates); None if neither has one.
    Special tokens come from tokenizer_config.json either way."""
    config_path = Path(engine_dir) / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"{config_path}: not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise ChatTemplateError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    if template_file is not None:
        path = Path(template_file)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"--chat-template {path}: cannot read it ({exc})") from None
        return ChatTemplate(source, special)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, special)
