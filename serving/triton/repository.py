"""Render a Triton model repository for a kiln engine: ``<repo>/<model>/config.pbtxt`` and
``<repo>/<model>/1/model.py``.

The runtime options (every ``ExecutorConfig`` field), the disaggregated mode's (every ``DisaggConfig`` field:
``prefill_workers`` > 0 makes the model a frontend over prefill and decode worker processes) and the admission
limit travel as model ``parameters`` (strings, "" for None); the model reads them back with
:func:`read_parameters` and :func:`read_disagg`, so a hand-edited config.pbtxt is checked by the same rules when
the model loads. Every option is validated before anything is written.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import typing
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import jinja2

from kiln.contract import ConfigError, EngineBounds
from kiln.runtime import Engine, ExecutorConfig
from kiln.runtime.disagg.config import DisaggConfig
from kiln.serving.triton.tensors import INPUTS, OUTPUTS

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
COPIED_ENGINE = "engine"   # --copy-engine puts the engine here, next to model.py


class OptionError(ConfigError):
    """An option that cannot be used; the message names it, the value given and the allowed values."""

    def __init__(self, option: str, value, allowed: str):
        super().__init__(f"{option}={value!r}: allowed values are {allowed}")
        self.option, self.value, self.allowed = option, value, allowed


@dataclass(frozen=True)
class RepoOptions:
    model_name: str = "kiln"
    instances: int = 1
    decoupled: bool = True
    copy_engine: bool = False
    max_queue_size: int = 0    # requests waiting for their first token above which new ones are refused; 0: no limit
    runtime: ExecutorConfig = field(default_factory=ExecutorConfig)
    lora_modules: tuple[str, ...] = ()   # "NAME=PATH" of each LoRA adapter the model loads
    int64_inputs: bool = False   # declare the integer inputs INT64 (kiln.serving.triton.tensors.WIDENED)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)   # prefill_workers > 0: prefill/decode workers

    def validate(self, bounds: EngineBounds) -> None:
        """OptionError for the first bad option (the engine's bounds included)."""
        if not MODEL_NAME_RE.match(self.model_name):
            raise OptionError("model_name", self.model_name, "letters, digits, '_', '.', '-' (a folder name; "
                              "'ensemble' makes a drop-in for TensorRT-LLM's clients)")
        if self.instances < 1:
            raise OptionError("instances", self.instances, ">= 1")
        check_runtime(self.runtime, self.max_queue_size, bounds)
        lora_modules(";".join(self.lora_modules))
        check_disagg(self.disagg, self.instances, ";".join(self.lora_modules))


def check_disagg(disagg: DisaggConfig, instances: int, lora: str) -> None:
    """What the disaggregated mode cannot be combined with in one model (``lora``: the lora_modules parameter)."""
    if not disagg.enabled:
        return
    if lora:
        raise OptionError("lora_modules", lora, "none with prefill_workers > 0 (disaggregated serving serves no "
                          "LoRA adapters yet)")
    if instances != 1:
        raise OptionError("instances", instances, "1 with prefill_workers > 0 (one frontend per model: each "
                          "instance would start prefill_workers + decode_workers workers of its own; raise those)")


def lora_modules(value: str) -> dict[str, str]:
    """The ``lora_modules`` parameter ("NAME=PATH;NAME=PATH") as LLM's lora_modules (OptionError naming a bad one)."""
    out: dict[str, str] = {}
    for spec in filter(None, (s.strip() for s in value.split(";"))):
        name, sep, path = (part.strip() for part in spec.partition("="))
        if not sep or not name or not path or '"' in spec or name in out:
            raise OptionError("lora_modules", spec, "NAME=PATH of a PEFT adapter directory, each name once (no "
                              "';' or '\"' in them)")
        out[name] = path
    return out


def check_runtime(config: ExecutorConfig, max_queue_size: int, bounds: EngineBounds) -> None:
    """What ExecutorConfig checks only when an LLM is built, checked before: its values against the engine."""
    for name in ("max_batch_size", "max_num_tokens"):
        value, limit = getattr(config, name), getattr(bounds, name)
        if value is not None and value > limit:
            raise OptionError(name, value, f"1..{limit} (the engine's bound; rebuild it to raise it)")
    if config.max_kv_cache_tokens is not None and config.max_kv_cache_tokens < bounds.tokens_per_block:
        raise OptionError("max_kv_cache_tokens", config.max_kv_cache_tokens,
                          f">= {bounds.tokens_per_block} (one KV block)")
    if max_queue_size < 0:
        raise OptionError("max_queue_size", max_queue_size, ">= 0 (0: no limit)")


def _text(value) -> str:
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def parameters(options: RepoOptions, engine_dir: str) -> dict[str, str]:
    """The model's config.pbtxt parameters."""
    runtime = {f.name: _text(getattr(options.runtime, f.name)) for f in dataclasses.fields(ExecutorConfig)}
    disagg = {f.name: _text(getattr(options.disagg, f.name)) for f in dataclasses.fields(DisaggConfig)}
    return {"engine_dir": engine_dir, **runtime, "max_queue_size": str(options.max_queue_size),
            "lora_modules": ";".join(options.lora_modules), **disagg}


def read_parameters(params: dict[str, str]) -> tuple[ExecutorConfig, int]:
    """ExecutorConfig and max_queue_size from config.pbtxt parameters ("" or absent: the default); a value that
    does not parse raises OptionError, one ExecutorConfig refuses raises its ConfigError."""
    kwargs = _fields_of(ExecutorConfig, params)
    try:
        max_queue_size = int(params.get("max_queue_size", "").strip() or 0)
    except ValueError:
        raise OptionError("max_queue_size", params["max_queue_size"], "an integer") from None
    return ExecutorConfig(**kwargs), max_queue_size


def read_disagg(params: dict[str, str]) -> DisaggConfig:
    """DisaggConfig from config.pbtxt parameters (absent, as in a repository rendered before it: colocated)."""
    return DisaggConfig(**_fields_of(DisaggConfig, params))


def _fields_of(cls: type, params: dict[str, str]) -> dict:
    """The fields of dataclass ``cls`` given in ``params``, parsed by their annotations (OptionError naming one
    that does not parse)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in params:
            continue
        raw = params[f.name].strip()
        kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
        if not raw:   # "": None where the field takes it, else its default
            if type(None) in kinds:
                kwargs[f.name] = None
            continue
        kind = next(k for k in kinds if k is not type(None))
        try:
            if kind is bool:
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                kwargs[f.name] = raw.lower() in ("true", "1")
            else:
                kwargs[f.name] = kind(raw)
        except ValueError:
            allowed = {bool: "true or false", int: "an integer", float: "a number"}.get(kind, "a string")
            raise OptionError(f.name, raw, allowed) from None
    return kwargs


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("kiln.serving.triton", "templates"),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def _kiln_version() -> str:
    try:
        return metadata.version("kiln-llm")
    except metadata.PackageNotFoundError:
        return "unknown"


def render_repository(engine_dir: str | Path, output: str | Path, options: RepoOptions | None = None) -> Path:
    """Write the model folder for ``engine_dir`` into the repository ``output``; returns the model folder.

    Raises EngineLoadError (not an engine directory) or OptionError before writing anything.
    """
    options = options or RepoOptions()
    engine_dir = Path(engine_dir).resolve()
    config = Engine.read_config(engine_dir)
    options.validate(config.bounds)
    if any(c in str(engine_dir) for c in '"\\\n'):
        raise OptionError("engine_dir", str(engine_dir), "a path without quotes, backslashes or newlines "
                          "(it is written into config.pbtxt)")
    model_dir = Path(output) / options.model_name
    if model_dir.exists():
        raise OptionError("output", str(output), f"a repository without a {options.model_name}/ folder "
                          "(it exists: choose another output or model name, or remove it)")
    env = _environment()
    context = dict(name=options.model_name, decoupled=options.decoupled, instances=options.instances,
                   inputs=[t.declared(options.int64_inputs) for t in INPUTS], outputs=OUTPUTS,
                   kiln_version=_kiln_version(), engine=engine_dir.name,
                   parameters=parameters(options, COPIED_ENGINE if options.copy_engine else str(engine_dir)))
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(env.get_template("config.pbtxt.j2").render(**context))
    (model_dir / "1" / "model.py").write_text(env.get_template("model.py.j2").render(**context))
    if options.copy_engine:
        shutil.copytree(engine_dir, model_dir / "1" / COPIED_ENGINE)
    return model_dir
