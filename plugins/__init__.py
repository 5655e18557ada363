"""kiln.plugins: custom ops in the ``kiln`` namespace.

Importing this package registers every op (``torch.ops.kiln.*``), which is also what a
runtime needs before it can load a serialized engine that calls them.
"""

from kiln.plugins.activations import gelu, silu_mul
from kiln.plugins.paged_attention import paged_attention
from kiln.plugins.rms_norm import fused_add_rms_norm, rms_norm
from kiln.plugins.rotary import rotary_embedding
import kiln.plugins.weight_only_linear  # noqa: F401,E402  registers kiln::weight_only_linear, kiln::bf16_linear (module kept as the attribute)

__all__ = ["paged_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_mul", "gelu"]
