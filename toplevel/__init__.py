"""kiln: compiled static-graph LLM engines and their runtime (in-flight batching over a paged KV cache).

    import kiln

    llm = kiln.LLM("path/to/hf-checkpoint")          # or an engine directory written by build-engine
    out = llm.generate(["The kiln fires"], kiln.SamplingParams(max_tokens=32, temperature=0))

``kiln.LLM`` (``kiln.ondemand``) builds a Hugging Face checkpoint into the engine cache on first use
(``kiln.engine_cache``) and serves it with ``kiln.runtime.LLM``. The packages are ``kiln.<folder>`` of the
repository (``kiln.builder``, ``kiln.runtime``, ``kiln.serving``, ...); this one is the ``toplevel/`` folder.

Nothing is imported until a name is used, so ``import kiln.runtime`` (or any other subpackage) costs no
more than before: the names below resolve on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "kiln.ondemand",
    "SamplingParams": "kiln.runtime",
    "ExecutorConfig": "kiln.runtime",
    "BuildConfig": "kiln.builder",
    "KilnError": "kiln.contract",
    "ConfigError": "kiln.contract",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name == "__version__":
        from importlib import metadata

        try:
            value = metadata.version("kiln-llm")
        except metadata.PackageNotFoundError:  # pragma: no cover - not installed
            value = "0+unknown"
    else:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
