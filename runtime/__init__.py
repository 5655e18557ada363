"""kiln.runtime."""

from kiln.runtime.engine import Engine, EngineLoadError

__all__ = ["Engine", "EngineLoadError"]
