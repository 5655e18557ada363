"""The kiln ops a cpu-compiled engine's graph calls through C shims of the native library.

AOTInductor runs a custom op of a compiled graph through its proxy executor: for every call it builds an IValue
stack from the op's schema and dispatches boxed. A batch-1 decode step of the 246M Llama makes 81 such calls (its
linears and attention), each right after a weight stream has evicted the host code, so the path's length is paid
in cold cache misses (docs/benchmarks.md, session 28). With ``aot_inductor.custom_ops_to_c_shims`` the compiled
graph calls a C function per op instead; the native library defines them (``aoti_torch_cpu_<op>`` in
``plugins/csrc/linear_ops.cpp``, ``plugin_ops.cpp``, ``moe_ops.cpp`` and ``lora_ops.cpp``) over the ops' own CPU
kernels. The declarations below are the exact C signatures the AOTInductor C++ wrapper emits for the ops' schemas
(Tensor -> AtenTensorHandle, Tensor? -> AtenTensorHandle*, int and SymInt -> int64_t, bool -> int32_t, float ->
double, int[] -> a pointer and a length, the result through the last pointer); this module is their one owner.
"""

from __future__ import annotations

import torch

from kiln.plugins import native

__all__ = ["SHIMS", "custom_ops_to_c_shims"]

_T, _OPT = "AtenTensorHandle", "AtenTensorHandle*"
# op name -> its shim's parameters (the function is AOTITorchError aoti_torch_cpu_<op>(..., AtenTensorHandle* ret0))
SHIMS: dict[str, tuple[str, ...]] = {
    "weight_only_linear": (f"{_T} x", f"{_T} qweight", f"{_T} scales", f"{_OPT} bias", "int64_t bits",
                           "int64_t group_size", f"{_OPT} zeros"),
    "bf16_linear": (f"{_T} x", f"{_T} weight", f"{_OPT} bias"),
    "fp32_linear": (f"{_T} x", f"{_T} weight", f"{_OPT} bias"),
    "lora": (f"{_T} y", f"{_T} x", f"{_T} slots", f"{_T} weights", "const int64_t* segments", "int64_t segments_len_",
             "int64_t rank"),
    "moe": (f"{_T} x", f"{_T} router", f"{_T} gate_up", f"{_OPT} gate_up_scales", f"{_T} down", f"{_OPT} down_scales",
            "int64_t top_k", "int32_t renormalize", "int64_t bits", "int64_t group_size"),
    "paged_attention": (f"{_T} q", f"{_T} k", f"{_T} v", f"{_T} kv_cache", "int64_t layer", f"{_T} seq_lens",
                        f"{_T} context_lens", f"{_T} block_tables", f"{_T} slot_mapping", "double scale",
                        "int64_t sliding_window", "double softcap"),
}


def symbol(op: str) -> str:
    """The C function AOTInductor calls for ``kiln::<op>`` (its name rule: aoti_torch_<device>_<op name>)."""
    return f"aoti_torch_cpu_{op}"


def declaration(op: str) -> str:
    return f"AOTITorchError {symbol(op)}({', '.join((*SHIMS[op], f'{_OPT} ret0'))})"


def custom_ops_to_c_shims() -> dict:
    """The ``aot_inductor.custom_ops_to_c_shims`` value for a cpu-compiled build: every op of :data:`SHIMS` whose
    shim the loaded native library exports; empty without the library (the graph then calls the ops through the
    proxy executor, as engines built before these shims do)."""
    lib = native.library()
    if lib is None:
        return {}
    return {getattr(torch.ops.kiln, op).default: [declaration(op)] for op in SHIMS if hasattr(lib, symbol(op))}
