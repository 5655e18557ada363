"""kiln.clikit: what every kiln command line shares, so each option is defined once, on its dataclass.

``dataclass_options(cls)`` gives a click command one ``--option`` per field of a config dataclass
(``BuildConfig`` for ``build-engine``, ``ExecutorConfig`` and ``SamplingParams`` for ``kiln generate``,
``ExecutorConfig`` for ``kiln serve``): the name from the field, the type from its annotation, the help
text from ``field(metadata={"help": ...})``, the accepted values from ``metadata={"choices": ...}`` (shown,
not checked here) and the dataclass's default (shown, not applied here). Every option's own default is
"not given", and ``given(cls, kwargs)`` picks the values the user did give, so the dataclass applies its
defaults and validates its values itself: one set of defaults, each rule checked in one place::

    @click.command()
    @dataclass_options(ExecutorConfig, exclude=("seed",))
    def serve(**kwargs):
        config = ExecutorConfig(**given(ExecutorConfig, kwargs))   # ConfigError -> click.ClickException

Depends on click and the standard library only, so that every kiln package may import it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

_SCALARS = {int: click.INT, float: click.FLOAT, str: click.STRING}


def _option_kind(tp: Any) -> tuple[str, Any]:
    """('flag' | 'scalar' | 'multiple', click type) for a field annotation."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        lists = [a for a in args if typing.get_origin(a) is list]
        tp = lists[0] if lists else args[0]   # "list[str] | str | None" is given as a list
    if tp is bool:
        return "flag", None
    if typing.get_origin(tp) is list:
        return "multiple", _SCALARS[typing.get_args(tp)[0]]
    if tp in _SCALARS:
        return "scalar", _SCALARS[tp]
    raise TypeError(f"no command-line form for a field of type {tp!r}")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def dataclass_options(cls: type, *, exclude: Iterable[str] = (), help_prefix: str = "") -> Callable[[F], F]:
    """Decorator adding a click option for each field of dataclass ``cls`` (but ``exclude``): ``--max-tokens``
    for ``max_tokens``, ``--name/--no-name`` for a bool, a repeatable option for a list. Values arrive in
    the command's kwargs under the field names, None (or ``()``) when not given; see :func:`given`.
    ``help_prefix`` starts every option's help (e.g. to say when the options apply)."""
    hints = typing.get_type_hints(cls)
    skip = set(exclude)
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip and f.init]

    def decorate(fn: F) -> F:
        for f in reversed(fields):  # click applies decorators bottom-up: keep the dataclass's order in --help
            kind, ctype = _option_kind(hints[f.name])
            flag = f.name.replace("_", "-")
            help_text = help_prefix + f.metadata.get("help", "")
            choices = f.metadata.get("choices")
            default = _default_of(f)
            if default not in (dataclasses.MISSING, None, [], ()) and kind != "flag":
                help_text += f"  [default: {default}]"
            elif kind == "flag":
                help_text += f"  [default: {'on' if default else 'off'}]"
            metavar = f"[{'|'.join(choices)}]" if choices else None
            if kind == "flag":
                fn = click.option(f"--{flag}/--no-{flag}", f.name, default=None, help=help_text)(fn)
            else:
                fn = click.option(f"--{flag}", f.name, type=ctype, default=None, multiple=kind == "multiple",
                                  metavar=metavar, help=help_text)(fn)
        return fn

    return decorate


def given(cls: type, values: dict[str, Any], *, exclude: Iterable[str] = (), pop: bool = True) -> dict[str, Any]:
    """The values of ``cls``'s fields (but ``exclude``, as given to :func:`dataclass_options`) among click's
    ``values`` that the user gave (not None, not an empty repeatable), taken out of ``values`` (unless
    ``pop=False``) so that several dataclasses can share a command; repeatables come back as lists."""
    skip = set(exclude)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in values or f.name in skip:
            continue
        value = values.pop(f.name) if pop else values[f.name]
        if value is None or value == ():
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
