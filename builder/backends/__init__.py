"""Backends: turn the final ExportedProgram into ``rank0.engine``.

Each backend module has ``compile(ep, path, inputs) -> dict`` (stats for the build report).
"""

from __future__ import annotations

from types import ModuleType

from kiln.builder.backends import cpu, cpu_compiled

BACKENDS: dict[str, ModuleType] = {"cpu": cpu, "cpu-compiled": cpu_compiled}
