"""``kiln.LLM``: ``kiln.runtime.LLM`` that also takes a Hugging Face checkpoint directory.

    llm = kiln.LLM("path/to/hf-checkpoint")                                  # built once, cached, loaded
    llm = kiln.LLM("path/to/hf-checkpoint", build_config={"dtype": "bfloat16", "max_seq_len": 2048})
    llm = kiln.LLM("engines/llama")                                          # an engine directory, as before

The layer above both halves: a checkpoint is built through ``kiln.builder`` into the engine cache
(``kiln.engine_cache``) and the engine directory handed to ``kiln.runtime.LLM``, so the runtime still never
imports the builder (and an engine directory never imports it either). ``kiln serve`` resolves its model
directory here too.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any

from kiln.contract import CONFIG_FILE, BuildConfigError, ConfigError, is_engine_dir
from kiln.runtime import LLM as RuntimeLLM
from kiln.runtime.executor import ExecutorConfig

logger = logging.getLogger("kiln.ondemand")


def _show_progress() -> None:
    """Building takes a while and its cache hit is worth knowing: when the application configured no logging,
    kiln.ondemand's messages go to stderr (as a build-engine run would print them)."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kiln: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def is_checkpoint_dir(path: Path) -> bool:
    """A directory with a Hugging Face config.json (not an engine's)."""
    return (path / CONFIG_FILE).is_file() and not is_engine_dir(path)


def as_build_config(build_config: Any):
    """A BuildConfig from a BuildConfig, a dict of its fields, a YAML file's path, or None (the defaults)."""
    from kiln.builder import BuildConfig

    if build_config is None:
        return BuildConfig()
    if isinstance(build_config, BuildConfig):
        return build_config.validate()
    if isinstance(build_config, dict):
        return BuildConfig.from_dict(build_config)
    if isinstance(build_config, (str, Path)):
        return BuildConfig.from_yaml(build_config)
    raise BuildConfigError(f"build_config must be a BuildConfig, a dict of its fields or a YAML file's path, got "
                           f"{type(build_config).__name__}")


def resolve_engine(model: str | Path, build_config: Any = None) -> Path:
    """The engine directory for ``model``: ``model`` itself when it is an engine directory (``build_config`` must
    then be None), else the cached engine of the checkpoint ``model`` built with ``build_config``."""
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{model}: no such directory; give an engine directory (build-engine's output) or a "
                          "Hugging Face checkpoint directory (config.json + *.safetensors, e.g. from "
                          "`huggingface-cli download MODEL --local-dir DIR`)")
    if not is_checkpoint_dir(path):
        if build_config is not None and is_engine_dir(path):
            raise ConfigError(f"{model} is an engine directory, already built (its BuildConfig is in its "
                              "config.json): build_config applies to a Hugging Face checkpoint; drop it, or pass "
                              "the checkpoint")
        return path   # an engine (or not: the runtime's EngineLoadError then says what is missing)
    _show_progress()
    from kiln.engine_cache import cached_engine

    build = as_build_config(build_config)
    from kiln.builder.build import stages

    return cached_engine(path, build, progress=functools.partial(_log_stage, stages(build)))


def _log_stage(runs: tuple[str, ...], stage: str, message: str) -> None:
    """build_engine's progress as build-engine prints it: "[2/7] trace ..." then "[2/7] trace done in 4.3 s"
    (``runs``: the stages this build runs)."""
    n = f"[{runs.index(stage) + 1}/{len(runs)}] " if stage in runs else ""
    rank = message.removeprefix("start").strip()   # "rank r/N" of a tensor-parallel build
    logger.info("  %s%s%s", n, stage, f" {rank} ..." if message.startswith("start") else f" {message}")


class LLM(RuntimeLLM):
    """``kiln.runtime.LLM`` over an engine directory or a Hugging Face checkpoint directory (built on first use
    with ``build_config``, a BuildConfig, a dict of its fields or a YAML path; the defaults when None) or a
    loaded ``Engine``. Every other argument is ``kiln.runtime.LLM``'s."""

    def __init__(self, model, tokenizer=None, *, config: ExecutorConfig | None = None, build_config: Any = None,
                 **options):
        from kiln.contract import check_option_names

        check_option_names(options, self.option_names(), "LLM")   # before minutes of building
        if isinstance(model, (str, Path)):
            model = resolve_engine(model, build_config)
        elif build_config is not None:
            raise ConfigError("build_config applies to a Hugging Face checkpoint directory, not to a loaded Engine")
        super().__init__(model, tokenizer, config=config, **options)

    @classmethod
    def option_names(cls) -> list[str]:
        return ["build_config", *super().option_names()]
