"""The KV pool as an output: ``kiln.paged_attention`` (which writes the pool in place) becomes
``kiln.paged_attention_functional`` per layer plus one ``kiln.kv_cache_update`` at the end of the graph,
whose result (the pool with every layer's new keys/values) the graph returns after the logits.

For backends whose graphs cannot write an input (ONNX: onnxruntime, TensorRT). Every layer's attention
reads the pool as it was before the step plus the step's own keys/values, so the one write at the end can
go into the input's own memory (the runtime binds the output to the input's buffer: see
``kiln.runtime.onnx_engine``); reading the pool before or after that write gives the same result.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils import _pytree as pytree

NAME = "functional_kv"
DESCRIPTION = ("paged attention -> attention over the pool as read + one KV write at the end, the pool "
               "returned as a second output (onnx, tensorrt)")


def run(gm: fx.GraphModule, ctx=None) -> dict:
    import kiln.plugins  # noqa: F401  (registers the ops)

    ops = torch.ops.kiln
    attention = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.paged_attention.default]
    if not attention:
        return {"layers": 0}
    keys, values = {}, {}
    pool = slot_mapping = None
    for node in attention:
        q, k, v, kv_cache, layer, *_ = node.args
        if not isinstance(layer, int) or layer in keys:
            raise ValueError(f"{node.name}: paged_attention layer {layer!r} is not a distinct constant")
        if pool is not None and kv_cache is not pool:
            raise ValueError(f"{node.name}: paged_attention reads another KV pool than the first layer")
        pool, slot_mapping = kv_cache, node.args[8]
        keys[layer], values[layer] = k, v
        node.target = ops.paged_attention_functional.default
    if sorted(keys) != list(range(len(keys))):
        raise ValueError(f"paged_attention layers {sorted(keys)} are not 0..{len(keys) - 1}")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    (result,) = output.args
    logits = result[0] if isinstance(result, (tuple, list)) else result
    with gm.graph.inserting_before(output):
        update = gm.graph.call_function(ops.kv_cache_update.default, (
            pool, [keys[i] for i in range(len(keys))], [values[i] for i in range(len(keys))], slot_mapping))
    output.args = ((logits, update),)
    codegen = gm.graph._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):  # ep.module(): outputs are unflattened by a spec
        codegen.pytree_info = codegen.pytree_info._replace(out_spec=pytree.tree_structure((0, 0)))
    gm.graph.lint()
    gm.recompile()
    return {"layers": len(keys)}
