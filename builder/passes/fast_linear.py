"""Remaining float GEMMs -> the plugin's streaming-GEMV linears: ``kiln.fp32_linear`` / ``kiln.bf16_linear``.

Decode is a GEMV per weight matrix: its speed is the rate at which the weights stream from
memory; prefill and batched decode are GEMMs. The plugin's kernels serve both from one weight
layout (``scripts/bench_kernels.py`` measures them against torch).

Weights are stored in panels where the shape allows (``pack_panels``: 16 output rows per panel, each
k's 16 weights side by side, [out/16, in, 16] for fp32 and [out/16, in/2, 16, 2] for bf16), so that
each panel the kernel reads is one sequential stream and one vector load feeds 16 outputs for every
row of x. An lm_head tied to the embedding table is packed too (it is the largest GEMM of a tied model's
decode step: Qwen3 0.6B, Llama 3.2 1B, Gemma 3), and the embedding lookups then gather their rows from the panels
(row r is lane r % 16 of panel r // 16), so the table is stored once. A weight that any other op reads stays plain:
packing it would store it twice. The experts of ``kiln.moe`` are packed the same way, expert by expert.
"""

from __future__ import annotations

from torch import fx

from kiln.builder.passes.common import (
    add_weight,
    attr,
    is_linear,
    is_moe,
    is_row_lookup,
    linear_bias,
    per_expert,
    prune_unused_attrs,
)

NAME = "fast_linear"
DESCRIPTION = ("float32 / bfloat16 GEMMs -> kiln.fp32_linear / kiln.bf16_linear on weights packed in "
               "16-row panels (streaming GEMV at decode, register-blocked GEMM for prefill)")


def _weight_readers(gm: fx.GraphModule) -> tuple[set[int], dict[int, list[fx.Node]]]:
    """ids of the tensors that some node other than a float linear or a row lookup reads (these stay plain), and
    each tensor's row lookups (through any of its get_attr nodes)."""
    shared: set[int] = set()
    lookups: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        key = id(attr(gm, node.target))
        for user in node.users:
            if is_row_lookup(user, node):
                lookups.setdefault(key, []).append(user)
            elif not (is_linear(user) and user.args[1] is node):
                shared.add(key)
    return shared, lookups


def _panel_rows(gm: fx.GraphModule, lookup: fx.Node, panels: fx.Node) -> None:
    """Replace ``aten.embedding(table, ids)`` by the same rows gathered from ``panels`` (the table packed)."""
    import torch

    from kiln.plugins.weight_format import PANEL

    aten = torch.ops.aten
    ids = lookup.args[1]
    with gm.graph.inserting_before(lookup):
        panel = gm.graph.call_function(aten.div.Tensor_mode, (ids, PANEL), {"rounding_mode": "floor"})
        lane = gm.graph.call_function(aten.remainder.Scalar, (ids, PANEL))
        # indices on dims 0 and 2: [*ids.shape, in] (fp32) or [*ids.shape, in / 2, 2] (bf16 pairs)
        rows = gm.graph.call_function(aten.index.Tensor, (panels, [panel, None, lane]))
        if attr(gm, panels.target).dim() == 4:
            rows = gm.graph.call_function(aten.flatten.using_ints, (rows, -2, -1))
    rows.meta.update(lookup.meta)
    lookup.replace_all_uses_with(rows)
    gm.graph.erase_node(lookup)


def run(gm: fx.GraphModule, ctx) -> dict:
    import torch

    from kiln.plugins.weight_format import can_pack_panels, pack_panels

    ops = {torch.float32: torch.ops.kiln.fp32_linear.default, torch.bfloat16: torch.ops.kiln.bf16_linear.default}
    shared, lookups_of = _weight_readers(gm)
    counts: dict[str, int] = {}
    packed = plain = 0  # GEMMs on packed / plain weights
    tied_lookups = 0    # embedding lookups that now gather from an lm_head's panels
    packed_cache: dict[int, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not is_linear(node):
            continue
        w = attr(gm, node.args[1].target)
        x = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
        op = ops.get(w.dtype)
        if op is None or w.dim() != 2 or (x is not None and x.dtype != w.dtype):
            continue
        w_node = node.args[1]
        if can_pack_panels(w) and id(w) not in shared:
            if id(w) not in packed_cache:
                lookups = lookups_of.get(id(w), [])
                # a tied table is named as the LM head, which streams it whole
                name = "lm_head" if lookups else node.args[1].target.removesuffix(".weight").removesuffix("_weight")
                # defined before every use: the lookups come before the LM head
                first = next(n for n in gm.graph.nodes if n is node or n in lookups) if lookups else node
                packed_cache[id(w)] = add_weight(gm, name + "_packed", pack_panels(w), first)
                for lookup in lookups:
                    _panel_rows(gm, lookup, packed_cache[id(w)])
                tied_lookups += len(lookups)
            w_node = packed_cache[id(w)]
            packed += 1
        else:
            plain += 1
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(op, (node.args[0], w_node, linear_bias(node)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        key = str(w.dtype).removeprefix("torch.")
        counts[key] = counts.get(key, 0) + 1
    moe_layers = _pack_experts(gm, pack_panels, can_pack_panels)
    prune_unused_attrs(gm)
    return {"replaced": counts, "packed": packed, "plain": plain, "tied_lookups": tied_lookups,
            "packed_moe_layers": moe_layers}


def _pack_experts(gm: fx.GraphModule, pack_panels, can_pack_panels) -> int:
    """Float kiln.moe experts in the activations' dtype -> panels, expert by expert (the kernels' layout)."""
    count = 0
    for node in list(gm.graph.nodes):
        if not is_moe(node, bits=0):
            continue
        x = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
        stacks = [attr(gm, node.args[i].target) for i in (2, 4)]
        if any(w.dim() != 3 or not can_pack_panels(w[0]) or (x is not None and x.dtype != w.dtype) for w in stacks):
            continue
        args = list(node.args)
        for i, w in zip((2, 4), stacks):
            args[i] = add_weight(gm, node.args[i].target + "_packed", per_expert(w, pack_panels), node)
        node.args = tuple(args)
        count += 1
    return count
