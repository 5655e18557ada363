"""Weight-only quantization: every constant-weight GEMM -> ``kiln.weight_only_linear`` on int8/int4 weights.

Weights are quantized at build time (int8: per output channel; int4: group-wise along the input,
``group_size`` weights per scale) by the plugin's ``quantize_int8`` / ``quantize_int4``; activations
stay in the engine dtype. The lm_head is quantized too (it is the largest single GEMM at decode).
int8 weights are stored in panels of 16 rows where the shape allows (``pack_panels``: each panel one sequential
stream, as in ``fast_linear``); int4 weights in int4 panels (``quantize_int4_panels``: 8 k of 16 rows per 64-byte
line, fp16 group scales), else kiln's plain int4 layout.
"""

from __future__ import annotations

from torch import fx

from kiln.builder.passes.common import (
    add_weight,
    attr,
    is_linear,
    linear_bias,
    prune_unused_attrs,
    weights_bytes,
)

NAME = "weight_only_quant"
DESCRIPTION = "GEMMs -> kiln.weight_only_linear with int8 (per channel) or int4 (group-wise) weights (--quantization)"


def _plugin():
    try:
        import kiln.plugins.linear  # noqa: F401  (registers kiln::weight_only_linear)
        from kiln.plugins import weight_format
    except ImportError as exc:  # pragma: no cover - the plugin ships with kiln
        raise RuntimeError(f"quantization needs kiln.plugins.linear ({exc})") from None
    return weight_format


def run(gm: fx.GraphModule, ctx) -> dict:
    mode = ctx.build.quantization if ctx is not None else "none"
    if mode == "none":
        return {"skipped": "quantization=none"}
    import torch

    fmt = _plugin()
    bits = 8 if mode == "int8_weight_only" else 4
    group = ctx.build.group_size if bits == 4 else 0
    before_bytes = weights_bytes(gm)
    count = packed = 0
    for node in list(gm.graph.nodes):
        if not is_linear(node):
            continue
        w = attr(gm, node.args[1].target)
        if w.dim() != 2:
            continue
        if bits == 4 and w.shape[1] % group:
            continue  # left in the engine dtype (reported)
        if bits == 8:
            qweight, scales = fmt.quantize_int8(w.float())
            if fmt.can_pack_panels(qweight):  # panels of 16 rows: the GEMM kernels' layout (fast_linear)
                qweight = fmt.pack_panels(qweight)
                packed += 1
        elif fmt.can_pack_int4_panels(w.shape[0], w.shape[1], group):
            panels = fmt.quantize_int4_panels(w.float(), group)   # symmetric: no zero points
            qweight, scales = panels.qweight, panels.scales
            packed += 1
        else:
            qweight, scales = fmt.quantize_int4(w.float(), group)
        base = node.args[1].target.removesuffix(".weight").removesuffix("_weight")
        q_node = add_weight(gm, f"{base}_q{bits}", qweight, node)
        s_node = add_weight(gm, f"{base}_scales", scales, node)  # as the kernel expects (fp32; fp16 in int4 panels)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(
                torch.ops.kiln.weight_only_linear.default,
                (node.args[0], q_node, s_node, linear_bias(node), bits, group),
            )
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    prune_unused_attrs(gm)
    return {"quantized_gemms": count, "packed": packed, "bits": bits, "group_size": group,
            "weights_bytes_before": before_bytes, "weights_bytes_after": weights_bytes(gm)}
