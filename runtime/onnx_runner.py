"""The ``onnx`` backend's step function: an onnxruntime session over rank0.engine.

The graph returns the logits and the updated KV pool (``kv_cache_out``). Both outputs are bound with
IOBinding to memory the runtime owns: the logits to a fresh tensor, the pool to the ``kv_cache`` input's
own buffer, so the step's keys/values land in the runtime's pool in place. This is sound because the graph
writes the pool once, with one ScatterND at the end, and every layer's attention reads the same values from
the pool before or after that write (see ``kiln.builder.passes.functional_kv``); onnxruntime's ScatterND
skips its input->output copy when both are the same buffer, so a step costs the same whatever the pool's
size (a separate output buffer would copy the whole pool every step).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kiln.contract import INPUT_NAMES, KV_CACHE_OUTPUT, OUTPUT_NAME, EngineConfig, EngineInputError, EngineLoadError

OPTIMIZATION_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
                       "all": "ORT_ENABLE_ALL"}
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int32: np.int32, torch.int64: np.int64,
          torch.int8: np.int8}


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise EngineLoadError(f"an onnx engine runs on onnxruntime, which is not installed ({exc}); "
                              "pip install 'kiln-llm[onnx]'") from None
    return onnxruntime


class OnnxRunner:
    """One onnxruntime session (CPU execution provider); ``runner(**inputs) -> logits``."""

    device = torch.device("cpu")

    def __init__(self, path: Path, config: EngineConfig):
        ort = _onnxruntime()
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(config.build.get("onnx_threads") or 0) or torch.get_num_threads()
        # onnxruntime's threads spin for a while after each run by default: between steps they would take the
        # cores from the step loop (scheduler, sampler) and from other engines in the process
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        level = OPTIMIZATION_LEVELS[config.build.get("onnx_optimization", "all")]
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        disabled = []
        if config.quantization != "none":
            # onnxruntime fuses DequantizeLinear + MatMul on a constant weight into its MatMulNBits kernel; keep the
            # activations in fp32 there, as the lowering defines them (its default level 4 quantises them to int8:
            # 0.12 max logit error against the cpu engine's int8 on the tiny test Llama), and fuse MatMul + residual
            # Add into Gemm no more, which ran first and kept half the quantized GEMMs from that kernel
            options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
            disabled.append("MatMulAddFusion")
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                                                disabled_optimizers=disabled)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise EngineLoadError(f"{path}: onnxruntime cannot load the onnx engine ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); the file is corrupt, "
                                  "truncated or its .data file is missing: rebuild the engine") from exc
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        if inputs != list(INPUT_NAMES) or outputs != [OUTPUT_NAME, KV_CACHE_OUTPUT]:
            raise EngineLoadError(f"{path}: the ONNX graph's inputs {inputs} / outputs {outputs} are not the engine "
                                  f"contract's {list(INPUT_NAMES)} / {[OUTPUT_NAME, KV_CACHE_OUTPUT]}; rebuild it")
        self.vocab_size = config.model.vocab_size
        self.threads = options.intra_op_num_threads

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        kv = inputs["kv_cache"]
        if not kv.is_contiguous():
            raise EngineInputError("kv_cache must be contiguous: the onnx engine writes it in place "
                                   "(use the engine's allocate_kv_cache)")
        binding = self.session.io_binding()
        held = []  # contiguous copies must outlive the run
        for name in INPUT_NAMES:
            t = inputs[name].contiguous()
            held.append(t)
            binding.bind_input(name, "cpu", 0, _NUMPY[t.dtype], list(t.shape), t.data_ptr())
        binding.bind_output(KV_CACHE_OUTPUT, "cpu", 0, _NUMPY[kv.dtype], list(kv.shape), kv.data_ptr())
        num_logits = inputs["logits_indices"].shape[0]
        logits = torch.empty(num_logits, self.vocab_size, dtype=torch.float32)
        if num_logits:
            binding.bind_output(OUTPUT_NAME, "cpu", 0, np.float32, list(logits.shape), logits.data_ptr())
        else:   # an empty tensor has no buffer to bind
            binding.bind_output(OUTPUT_NAME, "cpu")
        self.session.run_with_iobinding(binding)
        return logits
