"""The build flags of a command that takes a model directory (``kiln serve CHECKPOINT_DIR --dtype bfloat16 ...``).

Every ``BuildConfig`` field is a flag (as for ``build-engine``) plus ``--build-config YAML``; they apply when the
directory is a Hugging Face checkpoint (its engine is built with them, or found in the cache). A field that
is also a serving option (``max_batch_size``, ``max_num_tokens``: in both dataclasses) is one flag for both:
for a checkpoint it sets the engine's bound and the server runs with it. Given with an engine directory,
build flags are refused (the engine is built already).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kiln.builder.config import BuildConfig
from kiln.clikit import dataclass_options, given
from kiln.contract import option_names
from kiln.runtime import ExecutorConfig

F = TypeVar("F", bound=Callable[..., Any])

SHARED = tuple(n for n in option_names(BuildConfig) if n in option_names(ExecutorConfig))
EXCLUDE = (*SHARED, "disabled_passes")


def build_options(fn: F) -> F:
    """``--build-config`` and one flag per BuildConfig field (but the shared ones, which the serving options
    define, and disabled_passes); the values arrive under the field names (see :func:`build_config_from`)."""
    fn = dataclass_options(BuildConfig, exclude=EXCLUDE, help_prefix="[checkpoint build] ")(fn)
    return click.option("--build-config", type=click.Path(path_type=Path, dir_okay=False), default=None,
                        help="[checkpoint build] BuildConfig YAML for a checkpoint's engine (flags override it).")(fn)


def build_config_from(options: dict[str, Any]) -> tuple[dict[str, Any] | None, Path | None]:
    """Take the build flags out of ``options`` (click's values): (the given fields, the YAML path); the shared
    fields stay in ``options`` for the serving options and are copied into the given fields."""
    fields = given(BuildConfig, options, exclude=EXCLUDE)
    fields.update(given(BuildConfig, {n: options.get(n) for n in SHARED}))
    return (fields or None), options.pop("build_config", None)


def resolve(model_dir: Path, fields: dict[str, Any] | None, yaml_path: Path | None) -> Path:
    """The engine directory to serve for ``model_dir`` (an engine, or a checkpoint built or found in the
    cache with the flags); click errors name what is wrong."""
    from kiln.contract import KilnError
    from kiln.ondemand import is_checkpoint_dir, resolve_engine

    build = None
    if yaml_path is not None or fields:
        if not is_checkpoint_dir(model_dir):
            flags = [f"--{n.replace('_', '-')}" for n in (fields or {}) if n not in SHARED]
            flags += ["--build-config"] if yaml_path is not None else []
            if flags:
                raise click.UsageError(f"{', '.join(flags)}: build flags apply to a Hugging Face checkpoint directory; "
                                       f"{model_dir} is an engine, already built")
        else:
            try:
                base = BuildConfig.from_yaml(yaml_path) if yaml_path is not None else BuildConfig()
                build = base.replace(**fields) if fields else base
            except KilnError as exc:
                raise click.UsageError(str(exc)) from None
    try:
        return resolve_engine(model_dir, build)
    except KilnError as exc:
        raise click.ClickException(str(exc)) from None
