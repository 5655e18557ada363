"""``tensorrt``: rank0.engine is a TensorRT plan built from the ``onnx`` backend's graph.

The same ONNX model (plugins lowered to standard ops: TensorRT-RTX has no plugin API) is parsed by
TensorRT's ONNX parser -- ``tensorrt`` when it is installed and loads, else ``tensorrt_rtx``, which
builds plans on a machine without a GPU, so this path is built and checked everywhere. One optimization
profile per entry of ``num_tokens_profiles`` (:func:`profiles`). The network is strongly typed: the plan
computes in the ONNX graph's dtypes, i.e. the BuildConfig's dtype (TensorRT-RTX has no FP16/BF16 builder
flags; full TensorRT would honour them only on weakly typed networks). A node the parser rejects fails
the build with its name and op type.

Native TensorRT layers (add_attention, add_kv_cache_update, add_rotary_embedding, add_normalization)
are not used: whether they beat the standard-op graph can only be measured on a GPU.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kiln.builder.backends import onnx as onnx_backend
from kiln.contract import INPUT_AXES, INPUT_NAMES, EngineBuildError

SKIPPED_PASSES = onnx_backend.SKIPPED_PASSES
MODULES = ("tensorrt", "tensorrt_rtx")


def import_tensorrt() -> ModuleType:
    """``tensorrt`` if it loads (its libraries are there), else ``tensorrt_rtx``; EngineBuildError naming the
    extra to install when neither does. Creates no runtime (that needs a GPU)."""
    problems = []
    for name in MODULES:
        try:
            module = __import__(name)
            module.Builder   # noqa: B018  (the bindings import without their libraries on some installs)
            return module
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError of a missing libnvinfer, ...
            problems.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
    raise EngineBuildError("backend tensorrt needs TensorRT's Python bindings: pip install 'kiln-llm[tensorrt]' "
                           "(tensorrt-rtx-cu12, which builds plans without a GPU) or NVIDIA's tensorrt; "
                           + "; ".join(problems))


def profiles(build) -> list[dict[str, tuple[int, int, int]]]:
    """(min, opt, max) of every dynamic dim, one dict per optimization profile.

    Profile i covers num_tokens from the previous profile's max + 1 to ``num_tokens_profiles[i]``; the other
    dims are as large as the engine's bounds allow within it (num_seqs and num_logits at most num_tokens).
    opt: the BuildConfig's opt_num_tokens where the range holds it, and as many sequences as that many tokens
    can be (up to max_batch_size); full block tables; the pool of max_batch_size full-length sequences.
    """
    b = build.engine_bounds()
    tops = build.num_tokens_profiles or [b.max_num_tokens]
    max_blocks = b.max_num_blocks or 4 * b.max_batch_size * b.max_blocks_per_seq
    out = []
    lo = 1
    for hi in tops:
        opt_tokens = min(max(build.resolved_opt_num_tokens, lo), hi)
        seqs = min(b.max_batch_size, hi)
        logits = min(b.max_num_logits, hi)
        out.append({
            "num_tokens": (lo, opt_tokens, hi),
            "num_seqs": (1, min(seqs, opt_tokens), seqs),
            "num_logits": (0, min(logits, opt_tokens, seqs) if logits < hi else min(logits, opt_tokens), logits),
            "max_blocks_per_seq": (1, b.max_blocks_per_seq, b.max_blocks_per_seq),
            "num_blocks": (1, min(max_blocks, b.max_batch_size * b.max_blocks_per_seq), max_blocks),
        })
        lo = hi + 1
    return out


def input_shapes(example: dict[str, torch.Tensor], profile: dict[str, tuple[int, int, int]]
                 ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Each contract input's (min, opt, max) shape in ``profile``: its dynamic axes from the profile, the
    others (the pool's layers, heads, head size) as in the example step."""
    shapes = {}
    for name in INPUT_NAMES:
        axes, fixed = INPUT_AXES[name], tuple(example[name].shape)
        shapes[name] = tuple(tuple(profile[axes[a]][k] if a in axes else fixed[a] for a in range(len(fixed)))
                             for k in range(3))
    return shapes


class _Log:
    """A TensorRT logger that keeps the messages (for the build report) instead of printing them."""

    def __init__(self, trt: ModuleType):
        class Logger(trt.ILogger):
            def __init__(inner):
                trt.ILogger.__init__(inner)
                inner.lines: list[tuple[str, str]] = []

            def log(inner, severity, msg):
                inner.lines.append((str(severity).rsplit(".", 1)[-1], msg))

        self.logger = Logger()

    @property
    def lines(self) -> list[tuple[str, str]]:
        return self.logger.lines


def parse_onnx(trt: ModuleType, network, path: Path, logger) -> None:
    """Parse the ONNX model at ``path`` into ``network``; EngineBuildError naming each node TensorRT rejects."""
    parser = trt.OnnxParser(network, logger)
    if parser.parse_from_file(str(path)):
        return
    errors = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        errors.append(f"node {e.node_name() or '#' + str(e.node())!r} (op type {e.node_operator() or '?'}): "
                      f"{e.desc()}")
    raise EngineBuildError(f"TensorRT ({trt.__name__} {trt.__version__}) rejected the ONNX graph: "
                           + "; ".join(errors or ["no error reported"]))


def _network_io(network) -> dict[str, Any]:
    def tensors(count, get):
        return [{"name": get(i).name, "dtype": str(get(i).dtype).rsplit(".", 1)[-1], "shape": list(get(i).shape)}
                for i in range(count)]

    return {"inputs": tensors(network.num_inputs, network.get_input),
            "outputs": tensors(network.num_outputs, network.get_output)}


def _layer_summary(network) -> dict[str, int]:
    counts: dict[str, int] = {}
    for i in range(network.num_layers):
        kind = str(network.get_layer(i).type).rsplit(".", 1)[-1]
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _engine_layers(lines: list[tuple[str, str]], limit: int = 200) -> list[str]:
    """The layers of the built engine as the builder logs them at verbose level with detailed profiling
    verbosity (the engine inspector needs a deserialized engine, hence a GPU): one line per engine layer
    (TensorRT fuses most of the graph into a few Myelin "ForeignNode" layers)."""
    for _, msg in lines:
        head, _, rest = msg.partition("\n")
        if head.strip() in ("Layers:", "Engine Layer Information:"):
            return [line[:400] for line in rest.splitlines() if line.strip()][:limit]
    return []


def build_plan(onnx_path: Path, example: dict[str, torch.Tensor], build) -> tuple[bytes, dict[str, Any]]:
    """The serialized plan of the ONNX model at ``onnx_path`` and the facts for the build report."""
    trt = import_tensorrt()
    log = _Log(trt)
    builder = trt.Builder(log.logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parse_onnx(trt, network, onnx_path, log.logger)
    config = builder.create_builder_config()
    if hasattr(trt, "ProfilingVerbosity"):
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    wanted = profiles(build)
    read_back = []
    for dims in wanted:
        profile = builder.create_optimization_profile()
        shapes = input_shapes(example, dims)
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
        read_back.append({name: [list(s) for s in profile.get_shape(name)] for name in shapes})
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - t0
    problems = [msg for sev, msg in log.lines if sev in ("ERROR", "INTERNAL_ERROR")]
    if plan is None:
        raise EngineBuildError(f"TensorRT ({trt.__name__} {trt.__version__}) could not build the plan: "
                               + ("; ".join(problems[-5:]) or "no error logged"))
    return bytes(plan), {
        "module": trt.__name__,
        "version": trt.__version__,
        "build_s": round(seconds, 3),
        "precision": f"strongly typed: {build.dtype} (the ONNX graph's dtypes)",
        "profiles": [{"dims": {k: list(v) for k, v in dims.items()}, "shapes": shapes}
                     for dims, shapes in zip(wanted, read_back)],
        "network": {**_network_io(network), "num_layers": network.num_layers,
                    "layers_by_type": _layer_summary(network)},
        "engine_layers": _engine_layers(log.lines),
        "log": [f"{sev}: {msg}" for sev, msg in log.lines if sev in ("WARNING", "ERROR", "INTERNAL_ERROR", "INFO")],
    }


def compile(ep: torch.export.ExportedProgram, path: Path, inputs: dict[str, torch.Tensor], build) -> dict:
    trt_check = import_tensorrt()  # fail before the export when TensorRT is missing
    t0 = time.perf_counter()
    model = onnx_backend.export(ep)
    export_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="kiln-trt-") as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        onnx_backend.save(model, onnx_path)
        plan, facts = build_plan(onnx_path, inputs, build)
    path.write_bytes(plan)
    del trt_check
    return {"format": "tensorrt-plan", "plan_bytes": len(plan), "export_s": round(export_s, 3),
            "onnx": onnx_backend.model_facts(model), **facts}
