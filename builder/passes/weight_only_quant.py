"""Weight-only quantization: every constant-weight GEMM -> ``kiln.weight_only_linear`` on int8/int4 weights.

Weights are quantized at build time (int8: per output channel; int4: group-wise along the input,
``group_size`` weights per scale) by the plugin's ``quantize_int8`` / ``quantize_int4``; activations
stay in the engine dtype. The lm_head is quantized too (it is the largest single GEMM at decode).
int8 weights are stored in panels of 16 rows where the shape allows (``pack_panels``: each panel one sequential
stream, as in ``fast_linear``); int4 weights in int4 panels (``quantize_int4_panels``: 8 k of 16 rows per 64-byte
line, fp16 group scales), else kiln's plain int4 layout. The experts of ``kiln.moe`` are quantized the same
way, expert by expert (int4 in the plain layout; the router is not quantized: it stays a float GEMM inside the op).

The token embedding table (decode gathers one row of it per token; 131 MB in fp32 for a 32000 x 1024 table) is
stored quantized and dequantized after the gather. int8 engines: int8 rows with one fp32 scale per row
(``quantize_int8``'s scheme, error <= max|row| / 254), a quarter of the fp32 bytes. int4 engines: the table in
``quantize_int4``'s scheme and layout with the engine's group size (as llama.cpp's Q4_0 files hold their token
table), an eighth of the bytes plus the group scales; a width the group does not divide keeps int8 rows.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.builder.passes.common import (
    add_weight,
    attr,
    is_linear,
    is_moe,
    linear_bias,
    per_expert,
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
    moe_layers = _quantize_experts(gm, fmt, bits, group)
    embeddings = _quantize_embeddings(gm, fmt, bits, group)
    prune_unused_attrs(gm)
    return {"quantized_gemms": count, "packed": packed, "quantized_moe_layers": moe_layers, "bits": bits,
            "group_size": group, "quantized_embeddings": embeddings,
            "weights_bytes_before": before_bytes, "weights_bytes_after": weights_bytes(gm)}


def _quantize_embeddings(gm: fx.GraphModule, fmt, bits: int, group: int) -> int:
    """``aten.embedding(table, ids)`` on a float table -> quantized rows gathered and dequantized in graph ops, in
    the table's dtype (int4 where ``bits`` is 4 and ``group`` divides the width, else int8). Returns how many
    tables were quantized."""
    aten = torch.ops.aten
    done = 0
    tables: dict[str, tuple[fx.Node, fx.Node, int]] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.embedding.default:
            continue
        table = node.args[0]
        if not (isinstance(table, fx.Node) and table.op == "get_attr"):
            continue
        w = attr(gm, table.target)
        if not w.is_floating_point() or w.dim() != 2:
            continue
        if table.target not in tables:
            base = table.target.removesuffix(".weight").removesuffix("_weight")
            gs = group if bits == 4 and w.shape[1] % group == 0 else 0
            if gs:
                q, scales = fmt.quantize_int4(w.float(), gs)
                q_name, s_name = f"{base}_q4", f"{base}_group_scales"
            else:
                q, scales = fmt.quantize_int8(w.float())
                q_name, s_name, scales = f"{base}_q8", f"{base}_row_scales", scales[:, None].contiguous()
            tables[table.target] = (add_weight(gm, q_name, q, node), add_weight(gm, s_name, scales, node), gs)
        q_node, s_node, gs = tables[table.target]
        ids = node.args[1]
        with gm.graph.inserting_before(node):
            rows = gm.graph.call_function(aten.embedding.default, (q_node, ids))
            scale = gm.graph.call_function(aten.embedding.default, (s_node, ids))
            if gs:
                out = _dequantize_int4_rows(gm.graph, rows, scale, w.shape[1], gs)
            else:
                rows = gm.graph.call_function(aten._to_copy.default, (rows,), {"dtype": torch.float32})
                out = gm.graph.call_function(aten.mul.Tensor, (rows, scale))
            if w.dtype != torch.float32:
                out = gm.graph.call_function(aten._to_copy.default, (out,), {"dtype": w.dtype})
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        done += 1
    return done


def _dequantize_int4_rows(graph: fx.Graph, rows: fx.Node, scales: fx.Node, width: int, gs: int) -> fx.Node:
    """Graph ops: gathered rows [T, width/2] uint8 in ``quantize_int4``'s layout and their group scales [T, width/gs]
    -> [T, width] fp32 (``weight_format.unpack_int4`` in ops that every backend lowers: AND, shift, reshape)."""
    aten = torch.ops.aten
    call = graph.call_function
    rows = call(aten._to_copy.default, (rows,), {"dtype": torch.int32})   # ONNX's bitwise ops keep one int type
    lo = call(aten.bitwise_and.Scalar, (rows, 15))
    hi = call(aten.bitwise_right_shift.Tensor_Scalar, (rows, 4))
    nib = call(aten.stack.default, ([lo, hi], -1))                  # [T, width/2, 2]: byte b's low, then high nibble
    blocks = (width // 64) * 64
    parts = []
    if blocks:   # a 64-block's byte 2l + jh holds j = 2jh (low) and 2jh + 1 (high) of elements j * 16 + l
        head = call(aten.slice.Tensor, (nib, 1, 0, blocks // 2))
        head = call(aten.reshape.default, (head, [-1, blocks // 64, 16, 4]))
        head = call(aten.transpose.int, (head, 2, 3))
        parts.append(call(aten.reshape.default, (head, [-1, blocks])))
    if width > blocks:   # the tail: plain pairs
        tail = call(aten.slice.Tensor, (nib, 1, blocks // 2, width // 2))
        parts.append(call(aten.reshape.default, (tail, [-1, width - blocks])))
    u = parts[0] if len(parts) == 1 else call(aten.cat.default, (parts, 1))
    u = call(aten._to_copy.default, (u,), {"dtype": torch.float32})
    signed = call(aten.sub.Tensor, (u, call(aten.mul.Tensor, (call(aten.ge.Scalar, (u, 8)), 16))))   # 8..15 -> -8..-1
    grouped = call(aten.reshape.default, (signed, [-1, width // gs, gs]))
    out = call(aten.mul.Tensor, (grouped, call(aten.unsqueeze.default, (scales, -1))))
    return call(aten.reshape.default, (out, [-1, width]))


def _quantize_experts(gm: fx.GraphModule, fmt, bits: int, group: int) -> int:
    """Every float kiln.moe's experts, each expert as the GEMMs above (int8 in panels where they fit, or int4); the
    router stays in the engine dtype. An MoE layer whose widths the int4 group does not divide stays float."""
    count = 0
    for node in list(gm.graph.nodes):
        if not is_moe(node, bits=0):
            continue
        stacks = [attr(gm, node.args[i].target) for i in (2, 4)]
        if bits == 4 and any(w.shape[2] % group for w in stacks):
            continue
        new = []
        for i, w in zip((2, 4), stacks):
            if bits == 8:
                q, s = per_expert(w.float(), fmt.quantize_int8)
                if fmt.can_pack_panels(q[0]):
                    q = per_expert(q, fmt.pack_panels)
            else:
                q, s = per_expert(w.float(), lambda m: fmt.quantize_int4(m, group))
            base = node.args[i].target
            new += [add_weight(gm, f"{base}_q{bits}", q, node), add_weight(gm, f"{base}_scales", s, node)]
        args = list(node.args)
        args[2], args[3], args[4], args[5], args[8], args[9] = new[0], new[1], new[2], new[3], bits, group
        node.args = tuple(args)
        count += 1
    return count
