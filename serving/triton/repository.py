"""Render a Triton model repository for a kiln engine: ``<repo>/<model>/config.pbtxt`` and ``<repo>/<model>/1/model.py``.

The runtime options travel as model ``parameters`` (strings, "" for "the engine's own"); the model reads them
back with :func:`runtime_options`, so a hand-edited config.pbtxt is checked with the same rules at load time.
Every option is validated before anything is written.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, fields
from importlib import metadata
from pathlib import Path

import jinja2

from kiln.runtime import Engine
from kiln.runtime.scheduler import CAPACITY_POLICIES
from kiln.serving.triton.tensors import INPUTS, OUTPUTS

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
COPIED_ENGINE = "engine"   # --copy-engine puts the engine here, next to model.py


class OptionError(ValueError):
    """An option that cannot be used; the message names it, the value given and the allowed values."""

    def __init__(self, option: str, value, allowed: str):
        super().__init__(f"{option}={value!r}: allowed values are {allowed}")
        self.option, self.value, self.allowed = option, value, allowed


@dataclass(frozen=True)
class RuntimeOptions:
    """What each model instance passes to ``kiln.runtime.LLM`` (None: the engine's own / kiln's default),
    plus the instance's admission limit."""

    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_kv_cache_tokens: int | None = None
    capacity_policy: str = "guaranteed_no_evict"
    enable_prefix_reuse: bool = True
    max_queue_size: int = 0     # requests waiting for their first token above which new ones are refused; 0: no limit

    def validate(self, build: dict) -> None:
        """OptionError for the first bad option, against the engine's build bounds."""
        for name in ("max_batch_size", "max_num_tokens"):
            value, limit = getattr(self, name), int(build[name])
            if value is not None and not 1 <= value <= limit:
                raise OptionError(name, value, f"1..{limit} (the engine's bound; rebuild it to raise it)")
        f = self.kv_cache_memory_fraction
        if f is not None and not 0.0 < f <= 1.0:
            raise OptionError("kv_cache_memory_fraction", f, "in (0, 1]")
        block = int(build["tokens_per_block"])
        if self.max_kv_cache_tokens is not None and self.max_kv_cache_tokens < block:
            raise OptionError("max_kv_cache_tokens", self.max_kv_cache_tokens, f">= {block} (one KV block)")
        if self.capacity_policy not in CAPACITY_POLICIES:
            raise OptionError("capacity_policy", self.capacity_policy, ", ".join(CAPACITY_POLICIES))
        if self.max_queue_size < 0:
            raise OptionError("max_queue_size", self.max_queue_size, ">= 0 (0: no limit)")

    def llm_kwargs(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "max_queue_size"}
        if out["kv_cache_memory_fraction"] is None:
            del out["kv_cache_memory_fraction"]   # kiln's default
        return out

    def as_parameters(self) -> dict[str, str]:
        def text(v) -> str:
            return "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
        return {f.name: text(getattr(self, f.name)) for f in fields(self)}


def runtime_options(parameters: dict[str, str]) -> RuntimeOptions:
    """RuntimeOptions from config.pbtxt parameters (strings; "" or absent: default), OptionError naming a bad one."""
    kwargs = {}
    for f in fields(RuntimeOptions):
        raw = parameters.get(f.name, "").strip()
        if not raw:
            continue
        kind = str(f.type)   # a string: this module has `from __future__ import annotations`
        try:
            if kind.startswith("bool"):
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                kwargs[f.name] = raw.lower() in ("true", "1")
            elif kind.startswith("int"):
                kwargs[f.name] = int(raw)
            elif kind.startswith("float"):
                kwargs[f.name] = float(raw)
            else:
                kwargs[f.name] = raw
        except ValueError:
            allowed = {"bool": "true or false", "int": "an integer", "float": "a number"}[kind.split(" ")[0]]
            raise OptionError(f.name, raw, allowed) from None
    return RuntimeOptions(**kwargs)


@dataclass(frozen=True)
class RepoOptions:
    model_name: str = "kiln"
    instances: int = 1
    decoupled: bool = True
    copy_engine: bool = False
    runtime: RuntimeOptions = RuntimeOptions()

    def validate(self, build: dict) -> None:
        if not MODEL_NAME_RE.match(self.model_name):
            raise OptionError("model_name", self.model_name, "letters, digits, '_', '.', '-' (a folder name; "
                              "'ensemble' makes a drop-in for TensorRT-LLM's clients)")
        if self.instances < 1:
            raise OptionError("instances", self.instances, ">= 1")
        self.runtime.validate(build)


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("kiln.serving.triton", "templates"),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def _kiln_version() -> str:
    try:
        return metadata.version("kiln-llm")
    except metadata.PackageNotFoundError:
        return "unknown"


def render_repository(engine_dir: str | Path, output: str | Path, options: RepoOptions = RepoOptions()) -> Path:
    """Write the model folder for ``engine_dir`` into the repository ``output``; returns the model folder.

    Raises EngineLoadError (not an engine directory) or OptionError before writing anything.
    """
    engine_dir = Path(engine_dir).resolve()
    config = Engine.read_config(engine_dir)
    options.validate(config["build"])
    if any(c in str(engine_dir) for c in '"\\\n'):
        raise OptionError("engine_dir", str(engine_dir), "a path without quotes, backslashes or newlines "
                          "(it is written into config.pbtxt)")
    model_dir = Path(output) / options.model_name
    if model_dir.exists():
        raise OptionError("output", str(output), f"a repository without a {options.model_name}/ folder "
                          "(it exists: choose another output or model name, or remove it)")
    env = _environment()
    params = {"engine_dir": COPIED_ENGINE if options.copy_engine else str(engine_dir),
              **options.runtime.as_parameters()}
    context = dict(name=options.model_name, decoupled=options.decoupled, instances=options.instances,
                   inputs=INPUTS, outputs=OUTPUTS, parameters=params, kiln_version=_kiln_version(),
                   engine=engine_dir.name)
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(env.get_template("config.pbtxt.j2").render(**context))
    (model_dir / "1" / "model.py").write_text(env.get_template("model.py.j2").render(**context))
    if options.copy_engine:
        shutil.copytree(engine_dir, model_dir / "1" / COPIED_ENGINE)
    return model_dir
