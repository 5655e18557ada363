"""kiln.builder: BuildConfig, trace, passes, memory plan, backends and ``build_engine``."""

from kiln.builder.build import build_engine
from kiln.builder.config import BuildConfig
from kiln.contract import BuildConfigError

__all__ = ["BuildConfig", "BuildConfigError", "build_engine"]
