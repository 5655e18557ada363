"""Backends: turn the final ExportedProgram into ``rank0.engine``.

Each backend module has ``compile(ep, path, inputs, build) -> dict`` (stats for the build report) and may
name the passes it does not use (``SKIPPED_PASSES``, name -> why).
"""

from __future__ import annotations

from types import ModuleType

from kiln.builder.backends import cpu, cpu_compiled, onnx, tensorrt

BACKENDS: dict[str, ModuleType] = {"cpu": cpu, "cpu-compiled": cpu_compiled, "onnx": onnx, "tensorrt": tensorrt}
