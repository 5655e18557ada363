"""Click options derived from ``ExecutorConfig``'s fields: the same names, types and defaults, so a runtime
option added there is a ``kiln serve`` flag without touching the server."""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable

import click

from kiln.runtime.executor import ExecutorConfig

_SCALARS = {int: click.INT, float: click.FLOAT, str: click.STRING}


def _field_help(cls: type) -> dict[str, str]:
    """Help per field from the class docstring's ``name: text`` / ``a / b: text`` lines."""
    out = {}
    for line in (cls.__doc__ or "").splitlines():
        m = re.match(r"\s*([a-z_]+(?:\s*/\s*[a-z_]+)*):\s*(.+)", line)
        if m:
            for name in re.split(r"\s*/\s*", m.group(1)):
                out[name] = m.group(2).strip()
    return out


def executor_options(command: Callable) -> Callable:
    """Decorate a click command with one option per ExecutorConfig field."""
    hints = typing.get_type_hints(ExecutorConfig)
    helps = _field_help(ExecutorConfig)
    for f in reversed(dataclasses.fields(ExecutorConfig)):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        help_text = helps.get(f.name, "")
        if args[0] is bool:
            option = click.option(f"{flag}/--no-{flag[2:]}", f.name, default=f.default, show_default=True,
                                  help=help_text)
        else:
            option = click.option(flag, f.name, type=_SCALARS[args[0]], default=f.default, show_default=True,
                                  help=help_text)
        command = option(command)
    return command


def split_executor_options(options: dict) -> tuple[dict, dict]:
    """(ExecutorConfig keyword arguments, the rest) of a command's parsed options."""
    names = {f.name for f in dataclasses.fields(ExecutorConfig)}
    return {k: v for k, v in options.items() if k in names}, {k: v for k, v in options.items() if k not in names}
