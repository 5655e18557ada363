"""Dead code and duplicate subexpression removal.

CSE merges pure nodes (same op, same arguments) and duplicate get_attr reads; ops that mutate
an argument (the attention plugin writes the KV pool) are never merged or removed.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

NAME = "dead_code"
DESCRIPTION = "remove unused nodes and merge duplicate pure subexpressions (CSE)"


def _pure(node: fx.Node) -> bool:
    if node.op == "get_attr":
        return True
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        if schema.is_mutable or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return False
        name = str(target)
        if "rand" in name or "dropout" in name or "assert" in name or "empty" in name:
            return False
        return True
    return False


def _key(value):
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    if isinstance(value, fx.Node):
        return ("node", id(value))
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, float):
        return ("float", value)
    return (type(value).__name__, repr(value))


def cse(gm: fx.GraphModule) -> int:
    seen: dict[tuple, fx.Node] = {}
    merged = 0
    for node in list(gm.graph.nodes):
        if not _pure(node):
            continue
        key = (node.op, str(node.target), _key(node.args), _key(node.kwargs))
        prev = seen.get(key)
        if prev is None:
            seen[key] = node
            continue
        node.replace_all_uses_with(prev)
        gm.graph.erase_node(node)
        merged += 1
    return merged


def dce(gm: fx.GraphModule) -> int:
    before = len(gm.graph.nodes)
    for node in list(gm.graph.nodes):  # the export guard module is re-created by the next export
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    return before - len(gm.graph.nodes)


def run(gm: fx.GraphModule, ctx=None) -> dict:
    merged = cse(gm)
    removed = dce(gm)
    return {"cse_merged": merged, "dce_removed": removed}
