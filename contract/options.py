"""Unknown option names: a clear ConfigError instead of a dataclass's TypeError or a silently ignored key.

One rule for every option bag kiln takes by name (``LLM(..., **options)``, the config dataclasses'
keywords, the keys of a build-config YAML): a name that is not an option raises :class:`ConfigError`
(or the subclass given) naming it, the closest valid name ("did you mean 'max_batch_size'?") and the
list of valid ones. The valid names come from the dataclass's own fields, so a field added later is
accepted (and suggested) without anyone keeping a list.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Iterable, Sequence
from typing import TypeVar

from kiln.contract.errors import ConfigError

T = TypeVar("T", bound=type)


def option_names(cls: type) -> list[str]:
    """The keyword options of dataclass ``cls``: its init fields, in declaration order."""
    return [f.name for f in dataclasses.fields(cls) if f.init]


def unknown_option_message(unknown: Sequence[str], valid: Sequence[str], owner: str, kind: str = "option") -> str:
    """"OWNER: unknown option 'x' (did you mean 'y'?); valid options: a, b, c"."""
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    plural = "s" if len(unknown) > 1 else ""
    return f"{owner}: unknown {kind}{plural} {', '.join(parts)}; valid {kind}s: {', '.join(valid)}"


def check_option_names(given: Iterable[str], valid: Sequence[str], owner: str, *, kind: str = "option",
                       error: type[ConfigError] = ConfigError) -> None:
    """Raise ``error`` naming every name of ``given`` that is not in ``valid`` (with the closest valid one)."""
    allowed = set(valid)
    unknown = [name for name in given if name not in allowed]
    if unknown:
        raise error(unknown_option_message(unknown, valid, owner, kind))


def reject_unknown_options(error: type[ConfigError] = ConfigError):
    """Class decorator for a dataclass (applied above ``@dataclass``): a keyword argument that is not one of its
    fields raises ``error`` naming it, the closest field and the list (instead of the generated
    ``__init__``'s TypeError). The fields are read at each call, so new fields need nothing here."""

    def decorate(cls: T) -> T:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            fields = type(self).__dataclass_fields__
            if any(name not in fields for name in kwargs):
                check_option_names(kwargs, option_names(type(self)), type(self).__name__, error=error)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        return cls

    return decorate
