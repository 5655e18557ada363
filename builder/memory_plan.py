"""Memory plan: liveness of every intermediate tensor at the max profile and an arena layout.

Sizes come from each node's fake tensor (``node.meta['val']``) with every symbolic size
replaced by the upper bound of its dim (``ep.range_constraints``): the largest step the
engine accepts. Views/slices alias their base (no new memory; they extend its lifetime).
The arena places buffers greedily, largest first, at the lowest offset that does not
overlap a buffer live at the same time.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from kiln.builder.passes.common import is_row_lookup

ALIGN = 64

# aten ops whose output is a view of their first input
_VIEW_OPS = {
    "view", "_unsafe_view", "slice", "select", "squeeze", "unsqueeze", "transpose", "permute", "expand",
    "t", "alias", "split", "split_with_sizes", "unflatten", "narrow", "as_strided", "detach", "chunk",
    "unbind", "reshape", "flatten",
}


@dataclass(frozen=True)
class Buffer:
    name: str
    size: int  # bytes, aligned
    start: int  # index of the defining step
    end: int  # index of the last step that reads it (inclusive)


@dataclass
class Placement:
    buffer: Buffer
    offset: int


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def overlaps_in_time(a: Buffer, b: Buffer) -> bool:
    return a.start <= b.end and b.start <= a.end


def plan_arena(buffers: Iterable[Buffer]) -> list[Placement]:
    """Greedy-by-size arena layout: no two buffers live at the same time share a byte."""
    placed: list[Placement] = []
    for buf in sorted(buffers, key=lambda b: (-b.size, b.start, b.name)):
        if buf.size == 0:
            placed.append(Placement(buf, 0))
            continue
        busy = sorted((p.offset, p.offset + p.buffer.size) for p in placed
                      if p.buffer.size and overlaps_in_time(p.buffer, buf))
        offset = 0
        for lo, hi in busy:
            if offset + buf.size <= lo:
                break
            offset = max(offset, hi)
        placed.append(Placement(buf, offset))
    return placed


def arena_size(placements: list[Placement]) -> int:
    return max((p.offset + p.buffer.size for p in placements), default=0)


def live_peak(buffers: Iterable[Buffer]) -> int:
    """The largest total size of buffers live at one step (a lower bound on any arena)."""
    events: dict[int, int] = {}
    for b in buffers:
        events[b.start] = events.get(b.start, 0) + b.size
        events[b.end + 1] = events.get(b.end + 1, 0) - b.size
    peak = cur = 0
    for t in sorted(events):
        cur += events[t]
        peak = max(peak, cur)
    return peak


# ---------------------------------------------------------------------------- graph liveness
def _max_sizes(ep: torch.export.ExportedProgram) -> dict:
    out = {}
    for sym, vr in ep.range_constraints.items():
        upper = vr.upper
        out[sym] = int(upper) if getattr(upper, "is_finite", False) and upper.is_Integer else None
        # None: unbounded (the KV pool size), not an activation dim
    return out


def _numel_at_max(shape, maxima: dict) -> int | None:
    import sympy

    n = 1
    for s in shape:
        if isinstance(s, int):
            n *= s
            continue
        expr = s.node.expr if isinstance(s, torch.SymInt) else sympy.sympify(s)
        free = expr.free_symbols
        subs = {}
        for sym in free:
            m = maxima.get(sym)
            if m is None:
                return None
            subs[sym] = m
        n *= int(expr.subs(subs))
    return n


def _is_view(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and _is_view(src)
    name = getattr(getattr(node.target, "_schema", None), "name", "")
    return name.removeprefix("aten::") in _VIEW_OPS


def graph_buffers(ep: torch.export.ExportedProgram) -> tuple[list[Buffer], list[str]]:
    """Activation buffers of ``ep``'s graph (inputs and weights excluded) and any it could not size."""
    graph = ep.graph_module.graph
    maxima = _max_sizes(ep)
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    base: dict[fx.Node, fx.Node] = {}  # node -> the buffer-owning node it aliases
    owners: list[fx.Node] = []
    unsized: list[str] = []
    sizes: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op != "call_function":
            continue
        src = node.args[0] if node.args else None
        if _is_view(node) and isinstance(src, fx.Node):
            base[node] = base.get(src, src)  # no memory of its own; keeps its base alive
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # tuple-valued ops are sized through their getitem outputs
        numel = _numel_at_max(val.shape, maxima)
        if numel is None:
            unsized.append(node.name)
            continue
        sizes[node] = align(numel * val.element_size())
        owners.append(node)
    last_use: dict[fx.Node, int] = {n: index[n] for n in owners}
    end = len(nodes)
    for node in nodes:
        for inp in node.all_input_nodes:
            owner = base.get(inp, inp)
            if owner in last_use:  # graph outputs stay live to the end
                last_use[owner] = max(last_use[owner], end if node.op == "output" else index[node])
    buffers = [Buffer(n.name, sizes[n], index[n], last_use[n]) for n in owners]
    return buffers, unsized


def plan(ep: torch.export.ExportedProgram) -> dict[str, Any]:
    """The arena plan of ``ep`` at its max profile, as a JSON-ready dict."""
    buffers, unsized = graph_buffers(ep)
    placements = plan_arena(buffers)
    return {
        "num_buffers": len(buffers),
        "activation_peak_bytes": arena_size(placements),
        "live_peak_bytes": live_peak(buffers),
        "naive_bytes": sum(b.size for b in buffers),
        "unsized": unsized,
        "buffers": [
            {"name": p.buffer.name, "offset": p.offset, "size": p.buffer.size, "start": p.buffer.start,
             "end": p.buffer.end}
            for p in sorted(placements, key=lambda p: (p.buffer.start, p.buffer.name))
        ],
    }


def weights_bytes(ep: torch.export.ExportedProgram) -> int:
    seen: dict[int, int] = {}
    for t in list(ep.state_dict.values()) + list(ep.constants.values()):
        if isinstance(t, torch.Tensor):
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _weight_nodes(ep: torch.export.ExportedProgram) -> Iterator[tuple[fx.Node, str, torch.Tensor]]:
    """(placeholder node, weight name, tensor) of every weight the program reads."""
    sig = ep.graph_signature
    names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    tensors = {**ep.state_dict, **ep.constants}
    for node in ep.graph.nodes:
        t = tensors.get(names.get(node.name)) if node.op == "placeholder" else None
        if isinstance(t, torch.Tensor):
            yield node, names[node.name], t


def gathered_weights(ep: torch.export.ExportedProgram) -> list[str]:
    """Names of the weights that only row lookups read: a decode step reads a row of each, not the whole
    (``kiln.runtime.weight_pages`` leaves them mapped). A tied table that the LM head reads in its panels is not one
    of them."""
    return sorted(name for node, name, _ in _weight_nodes(ep)
                  if node.users and all(is_row_lookup(u, node) for u in node.users))


def decode_read_bytes(ep: torch.export.ExportedProgram) -> int:
    """Weight bytes one decode step of one sequence reads: every weight, except that an embedding table (only read
    by ``aten.embedding``) gives one row, and the experts of a ``kiln.moe`` are read top_k of num_experts (each
    tensor once, however many ops read it). The step's bandwidth floor is this over the memory bandwidth."""
    share: dict[int, float] = {}   # storage -> bytes read
    for node, _, t in _weight_nodes(ep):
        nbytes = t.numel() * t.element_size()
        read = 0.0
        for user in node.users:
            target = getattr(user.target, "_schema", None)
            if is_row_lookup(user, node):
                read = max(read, nbytes / max(t.shape[0], 1))
            elif target is not None and target.name == "kiln::moe" and node in user.args[2:6]:
                read = max(read, nbytes * user.args[6] / user.args[1].meta["val"].shape[0])
            else:
                read = nbytes
        key = t.untyped_storage().data_ptr()
        share[key] = max(share.get(key, 0.0), read)
    return int(sum(share.values()))
