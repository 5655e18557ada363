"""Helpers shared by the passes: finding GEMMs, reading and adding weights, pruning."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import fx

import kiln.plugins.lora  # noqa: F401  (registers kiln::lora)

aten = torch.ops.aten
LINEAR = aten.linear.default
LORA = torch.ops.kiln.lora.default


def attr(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def is_weight(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr"


def is_linear(node: fx.Node) -> bool:
    """aten.linear(x, W[, b]) with W (and b) graph constants: a GEMM a pass may rewrite."""
    if node.op != "call_function" or node.target is not LINEAR:
        return False
    weight = node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return is_weight(weight) and (bias is None or is_weight(bias))


def is_row_lookup(node: fx.Node, table: fx.Node) -> bool:
    """aten.embedding with ``table`` as its table: a gather of whole rows (a decode step reads one of each)."""
    return node.op == "call_function" and node.target is aten.embedding.default and node.args[0] is table


MOE = "kiln::moe"


def is_moe(node: fx.Node, bits: int | None = None) -> bool:
    """kiln.moe with constant expert weights (and, given ``bits``, in that format: 0 = float)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or node.target.name() != MOE:
        return False
    return is_weight(node.args[2]) and is_weight(node.args[4]) and (bits is None or node.args[8] == bits)


def per_expert(w: torch.Tensor, fn: Callable) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``fn`` applied to each expert of a stacked weight [E, ...], its results stacked again (a tuple of stacks when
    ``fn`` returns a tuple)."""
    parts = [fn(w[e]) for e in range(w.shape[0])]
    if isinstance(parts[0], tuple):
        return tuple(torch.stack(p) for p in zip(*parts))
    return torch.stack(parts)


def linear_bias(node: fx.Node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


# Every GEMM op a graph can hold: aten.linear as traced, the plugins' linears the passes put in its place.
GEMM_OPS = frozenset({"aten::linear", "kiln::weight_only_linear", "kiln::fp32_linear", "kiln::bf16_linear"})


def count_gemms(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and isinstance(n.target, torch._ops.OpOverload) and n.target.name() in GEMM_OPS)


def add_weight(gm: fx.GraphModule, name: str, tensor: torch.Tensor, before: fx.Node) -> fx.Node:
    """Register ``tensor`` as a buffer of ``gm`` (unique name from ``name``) and return a get_attr node."""
    base = re.sub(r"[^0-9a-zA-Z_]", "_", name)
    unique, i = base, 1
    while hasattr(gm, unique):
        unique, i = f"{base}_{i}", i + 1
    gm.register_buffer(unique, tensor.contiguous(), persistent=True)
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(unique)


def prune_unused_attrs(gm: fx.GraphModule) -> int:
    """Drop get_attr nodes nobody uses, then parameters/buffers no get_attr reads. Returns bytes freed."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    freed = 0
    seen: set[int] = set()
    named = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if name in used:
            continue
        owner_path, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if id(tensor) not in seen:
            seen.add(id(tensor))
            freed += tensor.numel() * tensor.element_size()
        if leaf in owner._parameters:
            del owner._parameters[leaf]
        elif leaf in owner._buffers:
            del owner._buffers[leaf]
    return freed


def weights_bytes(gm: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for t in list(gm.parameters()) + list(gm.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def merge_sibling_linears(
    gm: fx.GraphModule, groups: Iterable[list[fx.Node]], fused_name: Callable[[list[fx.Node]], str]
) -> tuple[int, int]:
    """Replace each group of linears on the same input by one linear on concatenated weights + slices.

    Adapters (``kiln::lora`` on the linears' outputs) stay right: each reads its slice of the fused output;
    then :func:`merge_lora` makes them one op on the fused output. Returns the number of groups merged, and of
    those whose adapters were merged too.
    """
    merged = lora_merged = 0
    for group in groups:
        if len(group) < 2:
            continue
        x = group[0].args[0]
        biases = [linear_bias(n) for n in group]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            continue  # mixed bias: leave alone
        weights = [attr(gm, n.args[1].target) for n in group]
        if len({w.shape[1] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
            continue
        # insert right after the latest of the group's inputs: before the first linear of the group
        anchor = min(group, key=lambda n: _index(gm, n))
        w_node = add_weight(gm, fused_name(group) + "_weight", torch.cat(weights, 0), anchor)
        b_node = None
        if biases[0] is not None:
            b = torch.cat([attr(gm, bn.target) for bn in biases], 0)
            b_node = add_weight(gm, fused_name(group) + "_bias", b, anchor)
        parts = []
        with gm.graph.inserting_before(anchor):
            fused = gm.graph.call_function(LINEAR, (x, w_node, b_node) if b_node is not None else (x, w_node))
            start = 0
            for node, w in zip(group, weights):
                end = start + w.shape[0]
                part = gm.graph.call_function(aten.slice.Tensor, (fused, -1, start, end))
                node.replace_all_uses_with(part)
                parts.append(part)
                start = end
        for node in group:
            gm.graph.erase_node(node)
        lora_merged += merge_lora(gm, fused, parts)
        merged += 1
    return merged, lora_merged


def is_lora(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is LORA


def merge_lora(gm: fx.GraphModule, fused: fx.Node, parts: list[fx.Node]) -> bool:
    """The adapters of a merged GEMM's parts (``kiln::lora`` on each slice of ``fused``) -> one ``kiln::lora``
    on ``fused`` whose segments are theirs at their slices' columns; the slices then read its output (the
    columns of a part without an adapter are unchanged by it). Only when every adapted slice feeds nothing
    but its adapter, and the adapters share x, slots, pool and rank. Returns whether it merged."""
    loras = {}
    for part in parts:
        users = [u for u in part.users if is_lora(u) and u.args[0] is part]
        if users:
            if len(part.users) != 1:
                return False
            loras[part] = users[0]
    if not loras:
        return False
    shared = {tuple(u.args[1:4]) + (u.args[5],) for u in loras.values()}
    if len(shared) != 1:
        return False
    x, slots, weights, rank = next(iter(shared))
    segments: list[int] = []
    for part, u in loras.items():
        start = part.args[2]
        seg = list(u.args[4])
        for i in range(0, len(seg), 5):
            segments += [seg[i], seg[i + 1], seg[i + 2], seg[i + 3] + start, seg[i + 4]]
    with gm.graph.inserting_after(fused):
        adapted = gm.graph.call_function(LORA, (fused, x, slots, weights, segments, rank))
    adapted.meta.update(fused.meta)
    for part in parts:
        part.args = (adapted, *part.args[1:])
    for part, u in loras.items():
        u.replace_all_uses_with(part)
        gm.graph.erase_node(u)
    return True


def _index(gm: fx.GraphModule, node: fx.Node) -> int:
    for i, n in enumerate(gm.graph.nodes):
        if n is node:
            return i
    raise KeyError(node)


def sibling_groups(gm: fx.GraphModule, suffixes: tuple[str, ...]) -> list[list[fx.Node]]:
    """Linears reading the same input whose weight names end in each of ``suffixes`` (ordered as given)."""
    by_input: dict[fx.Node, dict[str, fx.Node]] = {}
    for node in gm.graph.nodes:
        if not is_linear(node):
            continue
        target = node.args[1].target
        for s in suffixes:
            if target.endswith(s):
                by_input.setdefault(node.args[0], {})[s] = node
    return [[found[s] for s in suffixes] for found in by_input.values() if len(found) == len(suffixes)]
