"""kiln.builder: BuildConfig, trace, passes, memory plan, backends and ``build_engine``."""

from kiln.builder.build import ENGINE_FORMAT_VERSION, build_engine
from kiln.builder.config import BuildConfig, BuildConfigError

__all__ = ["BuildConfig", "BuildConfigError", "build_engine", "ENGINE_FORMAT_VERSION"]
