"""kiln.plugins: custom ops in the ``kiln`` namespace.

Importing this package registers every op (``torch.ops.kiln.*``), which is also what a
runtime needs before it can load a serialized engine that calls them. Their CPU kernels live in
one native library (:mod:`kiln.plugins.native`); each op also has a plain-torch implementation.
"""

from kiln.plugins.activations import gelu, silu_mul
from kiln.plugins.argmax import argmax_rows
from kiln.plugins.collectives import all_gather, all_reduce
from kiln.plugins.linear import bf16_linear, fp32_linear, weight_only_linear
from kiln.plugins.lora import lora
from kiln.plugins.moe import moe
from kiln.plugins.native import native_kernels_available, native_kernels_disabled, set_native_kernels_enabled
from kiln.plugins.paged_attention import paged_attention
from kiln.plugins.rms_norm import fused_add_rms_norm, rms_norm
from kiln.plugins.rotary import rotary_embedding

__all__ = [
    "paged_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_mul", "gelu",
    "weight_only_linear", "bf16_linear", "fp32_linear", "lora", "moe", "all_reduce", "all_gather", "argmax_rows",
    "native_kernels_available", "native_kernels_disabled", "set_native_kernels_enabled",
]
