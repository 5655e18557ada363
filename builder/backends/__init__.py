"""Backends: turn the final ExportedProgram into ``rank0.engine``.

Each backend module has ``compile(ep, path, inputs, build) -> dict`` (stats for the build report) and may
name the passes it does not use (``SKIPPED_PASSES``, name -> why). A backend whose graph file holds no
weights sets ``SEPARATE_WEIGHTS = True``: the builder then writes them once into ``rank0.weights``
(kiln.contract.weights), under the names of ``ep.state_dict`` and ``ep.constants``, and the runtime gives
them to the loaded graph (``cpu``, ``cpu-compiled``). The ``onnx`` and ``tensorrt`` graphs keep their
weights (ONNX external data, the plan).
"""

from __future__ import annotations

from types import ModuleType

from kiln.builder.backends import cpu, cpu_compiled, onnx, tensorrt

BACKENDS: dict[str, ModuleType] = {"cpu": cpu, "cpu-compiled": cpu_compiled, "onnx": onnx, "tensorrt": tensorrt}
