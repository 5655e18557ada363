"""``onnx``: rank0.engine is an ONNX model (opset 21, standard ops only) that onnxruntime runs.

The final ExportedProgram goes through ``torch.onnx.export`` (the dynamo exporter: aten ops by its own
translations, kiln's plugin ops by their lowerings beside each plugin, :func:`kiln.plugins.onnx_ops.lowerings`).
The graph has the contract's inputs with its dim names (num_tokens, num_seqs, ...) as symbolic dims and two
outputs: ``logits`` and ``kv_cache_out``, the pool with the step's keys/values written (the
``functional_kv`` pass); the runtime binds that output to the input's memory, so nothing is copied.

Weights: the lowerings turn kiln's kernel layouts back into standard ones with graph ops, which are folded
here into the initializers the engine stores (DequantizeLinear on int8/int4 initializers). A model whose
initializers exceed 2 GB (protobuf's limit) keeps them in ``rank0.engine.data`` beside it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from kiln.contract import INPUT_AXES, KV_CACHE_OUTPUT, OUTPUT_NAME, BuildConfigError

SKIPPED_PASSES = {
    "fast_linear": "8-row weight tiles are a layout of kiln's CPU kernels; onnxruntime and TensorRT pick their own",
    "inline_plugins": "each plugin is exported through its own ONNX lowering",
}
EXTERNAL_DATA_BYTES = 2 << 30   # protobuf's limit on one serialized model


def external_data_file(path: Path) -> str:
    return path.name + ".data"


def _rename_dims(model, names: dict[str, str]) -> None:
    """Symbolic dims the exporter named after torch's symbols (s44 ...) -> the contract's names."""
    import onnx_ir as ir

    def fix(value) -> None:
        if value is None or value.shape is None:
            return
        dims = [ir.SymbolicDim(names.get(d.value, d.value)) if isinstance(d, ir.SymbolicDim) else d
                for d in value.shape]
        value.shape = ir.Shape(dims)

    graph = model.graph
    for value in [*graph.inputs, *graph.outputs]:
        fix(value)
    for node in graph:
        for value in node.outputs:
            fix(value)


def export(ep: torch.export.ExportedProgram):
    """The engine's ONNX model (an onnx_ir Model), weights folded into their final initializers."""
    import onnx_ir as ir
    import onnxscript.optimizer

    from kiln.plugins.onnx_ops import OPSET, lowerings

    if any(n.op == "call_function" and n.target is torch.ops.kiln.paged_attention.default for n in ep.graph.nodes):
        raise BuildConfigError("backend onnx/tensorrt needs the functional_kv pass (the graph may not write its "
                               "kv_cache input in place); do not disable it")
    quiet = logging.getLogger("torch.onnx._internal.exporter._registration")   # "torchvision is not installed"
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.ExitStack() as stack:  # the exporter prints stages
        stack.callback(quiet.setLevel, level)
        program = torch.onnx.export(ep, dynamo=True, opset_version=OPSET, custom_translation_table=lowerings(),
                                    output_names=[OUTPUT_NAME, KV_CACHE_OUTPUT], optimize=True, verbose=False)
    model = program.model
    # the lowerings' weight-layout ops on initializers (int4 nibbles, transposes) -> new initializers
    onnxscript.optimizer.fold_constants(model, input_size_limit=1 << 40, output_size_limit=1 << 40)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    ir.passes.common.LiftConstantsToInitializersPass(size_limit=16)(model)
    names = {}
    for value in model.graph.inputs:
        for axis, dim in INPUT_AXES.get(value.name, {}).items():
            d = value.shape[axis]
            if isinstance(d, ir.SymbolicDim) and d.value:
                names[d.value] = dim
    logits = model.graph.outputs[0]
    if logits.shape is not None and isinstance(logits.shape[0], ir.SymbolicDim) and logits.shape[0].value:
        names[logits.shape[0].value] = "num_logits"
    _rename_dims(model, names)
    model.producer_name = "kiln"
    return model


def initializer_bytes(model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def save(model, path: Path) -> dict[str, Any]:
    """Write ``model`` to ``path`` (weights inline, or in ``<path>.data`` above 2 GB); returns file facts."""
    import onnx_ir as ir

    weights = initializer_bytes(model)
    external = weights >= EXTERNAL_DATA_BYTES
    ir.save(model, path, external_data=external_data_file(path) if external else None)
    return {"external_data": external_data_file(path) if external else None, "weights_bytes": weights,
            "file_bytes": path.stat().st_size}


def model_facts(model) -> dict[str, Any]:
    """Opset, node counts by op type, inputs/outputs with their dims: for the build report and kiln inspect."""
    def shape(value) -> list:
        return [d if isinstance(d, int) else str(d) for d in value.shape] if value.shape is not None else []

    graph = model.graph
    dq = [n for n in graph if n.op_type == "DequantizeLinear"]
    return {
        "opset": model.opset_imports.get("", 0),
        "domains": sorted(d or "ai.onnx" for d in model.opset_imports),
        "num_nodes": len(graph),
        "nodes_by_op_type": dict(Counter(n.op_type for n in graph).most_common()),
        "dequantize_on_initializers": sum(1 for n in dq if n.inputs[0].is_initializer()),
        "dequantize_nodes": len(dq),
        "inputs": {v.name: shape(v) for v in graph.inputs},
        "outputs": {v.name: shape(v) for v in graph.outputs},
    }


def compile(ep: torch.export.ExportedProgram, path: Path, inputs: dict[str, torch.Tensor], build=None) -> dict:
    import onnx

    t0 = time.perf_counter()
    model = export(ep)
    t_export = time.perf_counter() - t0
    facts = save(model, path)
    onnx.checker.check_model(str(path), full_check=True)   # by path: a model with external data too
    return {"format": "onnx", "export_s": round(t_export, 3), **facts, **model_facts(model)}
