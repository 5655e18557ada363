"""ONNX lowering of paged attention in its functional form (``kiln::paged_attention_functional`` and
``kiln::kv_cache_update``, see :mod:`kiln.plugins.paged_attention`), in standard ops.

Attention, per layer: each sequence's context is gathered from the pool through its block table
(``Gather``: [S * width] slots, width = block table width x block size), this step's keys/values are put at
their positions in that copy (``ScatterND``), and every packed token attends to every gathered slot under
a token-level mask (same sequence, causal with the context offset, inside the sliding window; the scores
soft-capped first when ``softcap`` > 0): one
``MatMul``/``Softmax``/``MatMul`` per layer over [Hkv, T*group, S*width] for GQA, no loop over sequences.
Every shape comes from the inputs' dims (no data-dependent shape), which TensorRT needs. The cost: a token
scores the slots of every sequence of the step (masked), S times the useful work.

KV write, once per step: ``ScatterND`` of every layer's new keys/values into the pool at
(layer, k/v, slot // block_size, slot % block_size), returning the updated pool.

An int8 pool (:mod:`kiln.plugins.kv_quant_onnx`): the step's keys/values are quantized into rows of int8 numbers
and their scale's bytes before they are scattered (into the gathered copy and into the pool), and the gathered
rows are dequantized (``DequantizeLinear``, one scale per row) before the products.
"""

from __future__ import annotations

import torch

import kiln.plugins.paged_attention  # noqa: F401  (registers the ops)
from kiln.plugins import kv_quant_onnx
from kiln.plugins.onnx_ops import FLOAT, INT64, ints, op, scalar

INT8 = kv_quant_onnx.INT8


def _dims(x):
    return [int(d) if isinstance(d, int) else None for d in x.shape]


def _dim(x, axis: int):
    """x.shape[axis] as a 1-element int64 tensor."""
    return op.Shape(x, start=axis, end=axis + 1)


def _to_pool(x, kv_cache, head_dim: int):
    """Rows [..., head_dim] as the pool stores them (an int8 pool: quantized, with their scales)."""
    return kv_quant_onnx.quantize_rows(x, head_dim) if kv_cache.dtype == INT8 else op.CastLike(x, kv_cache)


def _from_pool(rows, kv_cache, head_dim: int):
    """The pool's rows -> float32 values [..., head_dim]."""
    return kv_quant_onnx.dequantize_rows(rows, head_dim) if kv_cache.dtype == INT8 else op.Cast(rows, to=FLOAT)


def paged_attention_functional(q, k, v, kv_cache, layer: int, seq_lens, context_lens, block_tables, slot_mapping,
                               scale: float, sliding_window: int, softcap: float = 0.0):
    _, hq, d = _dims(q)
    block_size, hkv, row = _dims(kv_cache)[3:6]
    group = hq // hkv
    lens = op.Cast(seq_lens, to=INT64)
    ctx = op.Cast(context_lens, to=INT64)
    ends = op.CumSum(lens, ints([0]))
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    tok = op.Range(zero, op.Squeeze(_dim(q, 0), ints([0])), one)                     # [T]
    seq_of = op.ReduceSum(op.Cast(op.GreaterOrEqual(op.Unsqueeze(tok, ints([1])), op.Unsqueeze(ends, ints([0]))),
                                  to=INT64), ints([1]), keepdims=0)                    # [T] sequence of each token
    pos = op.Add(op.Sub(op.Gather(ctx, seq_of), op.Gather(ends, seq_of)), tok)      # [T] absolute position
    width = op.Mul(_dim(block_tables, 1), ints([block_size]))                        # [1] slots per sequence
    # blocks are gathered straight from the whole pool seen as [L*2*NB] blocks: a Gather of the layer first
    # would copy the layer's whole pool every step
    num_blocks = _dim(kv_cache, 2)
    blocks = op.Reshape(kv_cache, op.Concat(ints([-1]), op.Shape(kv_cache, start=3), axis=0))  # [L*2*NB, bs, Hkv, D]
    first = op.Mul(op.Add(ints([2 * layer]), ints([0, 1])), num_blocks)              # [2]: layer's K and V blocks
    table = op.Add(op.Unsqueeze(first, ints([1, 2])), op.Cast(block_tables, to=INT64))  # [2, S, MB]
    gathered = op.Gather(blocks, table, axis=0)                                      # [2, S, MB, bs, Hkv, D]
    gathered = op.Reshape(gathered, ints([2, -1, hkv, row]))                          # [2, S*width, Hkv, row]
    rows = op.Unsqueeze(op.Add(op.Mul(seq_of, width), pos), ints([1]))                # [T, 1]
    keys = op.ScatterND(op.Gather(gathered, zero, axis=0), rows, _to_pool(k, kv_cache, d))
    values = op.ScatterND(op.Gather(gathered, one, axis=0), rows, _to_pool(v, kv_cache, d))
    keys, values = _from_pool(keys, kv_cache, d), _from_pool(values, kv_cache, d)
    slots = op.Range(zero, op.Squeeze(op.Mul(_dim(block_tables, 0), width), ints([0])), one)
    slot_seq, slot_pos = op.Div(slots, width), op.Mod(slots, width)
    # slots a sequence never wrote (its last block's tail, padded table entries) may hold anything: a masked
    # score still multiplies its value, and NaN * 0 is NaN
    written = op.Less(slot_pos, op.Gather(ctx, slot_seq))
    values = op.Where(op.Unsqueeze(written, ints([1, 2])), values, scalar(0.0, values))
    tok_pos = op.Unsqueeze(pos, ints([1]))
    mask = op.And(op.Equal(op.Unsqueeze(slot_seq, ints([0])), op.Unsqueeze(seq_of, ints([1]))),
                  op.LessOrEqual(op.Unsqueeze(slot_pos, ints([0])), tok_pos))          # [T, S*width]
    if sliding_window > 0:
        mask = op.And(mask, op.Greater(op.Unsqueeze(slot_pos, ints([0])),
                                       op.Sub(tok_pos, ints([sliding_window]))))
    n_slots = _dim(slots, 0)
    mask = op.Reshape(op.Expand(op.Unsqueeze(mask, ints([1])), op.Concat(_dim(q, 0), ints([group]), n_slots, axis=0)),
                      op.Concat(ints([-1]), n_slots, axis=0))                          # [T*group, S*width]
    qh = op.Reshape(op.Transpose(op.Reshape(op.Cast(q, to=FLOAT), ints([-1, hkv, group, d])), perm=[1, 0, 2, 3]),
                    ints([hkv, -1, d]))                                                # [Hkv, T*group, D]
    scores = op.Mul(op.MatMul(qh, op.Transpose(keys, perm=[1, 2, 0])), scalar(scale, keys))
    if softcap > 0:   # attention-logit soft-capping: cap * tanh(scores / cap)
        scores = op.Mul(op.Tanh(op.Div(scores, scalar(softcap, scores))), scalar(softcap, scores))
    scores = op.Where(mask, scores, scalar(float("-inf"), scores))
    out = op.MatMul(op.Softmax(scores, axis=-1), op.Transpose(values, perm=[1, 0, 2]))  # [Hkv, T*group, D]
    out = op.Reshape(op.Transpose(op.Reshape(out, ints([hkv, -1, group, d])), perm=[1, 0, 2, 3]), ints([-1, hq, d]))
    return op.CastLike(out, q)


def kv_cache_update(kv_cache, keys, values, slot_mapping):
    num_layers = len(keys)
    block_size = _dims(kv_cache)[3]
    head_dim = _dims(keys[0])[2]

    def stacked(tensors):
        return op.Concat(*[op.Unsqueeze(t, ints([0])) for t in tensors], axis=0)      # [L, T, Hkv, D]

    updates = op.Concat(op.Unsqueeze(stacked(keys), ints([1])), op.Unsqueeze(stacked(values), ints([1])), axis=1)
    slot = op.Cast(slot_mapping, to=INT64)
    shape = op.Concat(ints([num_layers, 2]), _dim(slot, 0), ints([1]), axis=0)           # [L, 2, T, 1]

    def index(values, layout):
        return op.Expand(op.Reshape(values, ints(layout)), shape)

    indices = op.Concat(
        index(ints(range(num_layers)), [num_layers, 1, 1, 1]),
        index(ints([0, 1]), [1, 2, 1, 1]),
        index(op.Div(slot, ints([block_size])), [1, 1, -1, 1]),
        index(op.Mod(slot, ints([block_size])), [1, 1, -1, 1]),
        axis=-1,
    )                                                                                   # [L, 2, T, 4]
    return op.ScatterND(kv_cache, indices, _to_pool(updates, kv_cache, head_dim))


LOWERINGS = {
    torch.ops.kiln.paged_attention_functional.default: paged_attention_functional,
    torch.ops.kiln.kv_cache_update.default: kv_cache_update,
}
