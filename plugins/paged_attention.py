"""Paged attention over a mixed batch of context (prefill) and generation sequences.

The op writes the step's new keys/values into the paged KV pool (in place, through
``slot_mapping``) and attends each sequence over its cached context through its block
table. Decode sequences (one new token each) are computed as one batch; context
sequences (several new tokens, causal with an offset) one at a time. Nothing loops
in Python over tokens or blocks.

CPU kernel: C++ (``plugins/csrc/plugin_ops.cpp``, in the native library, see
:mod:`kiln.plugins.native`) for fp32/bf16 q/k/v and pools: it writes the pool and runs
the decode sequences (one work item per sequence and kv head, the group's query heads sharing one
pass over the context read through the block table, fp32 softmax; only slots inside each context
are read, so garbage/NaN elsewhere in the pool cannot leak in), with no Python per call; context
sequences go to ``_context_sequences`` below (one call per sequence: kiln's causal attention kernel where
:mod:`kiln.plugins.attention` takes the case, else SDPA), except short ones (at most 16 new
tokens: a speculative decoding verify), which run on the decode kernel, one row per token over its own causal
prefix of the context. Other cases, and
``KILN_DISABLE_NATIVE_KERNELS=1``, run the plain-torch implementation ``_paged_attention_py``.

Per-call options (per layer): ``scale`` (the softmax scale of q.k), ``sliding_window`` (0 = full) and
``softcap`` (0 = off; else scores -> cap * tanh(scores / cap) before the softmax: Gemma 2's attention-logit
soft-capping, computed in fp32 on every path).

Shapes (packed tokens, see DESIGN.md):
    q [T, Hq, D], k/v [T, Hkv, D], kv_cache [L, 2, num_blocks, block_size, Hkv, D],
    seq_lens/context_lens [S] int32, block_tables [S, max_blocks] int32, slot_mapping [T] int64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.contract import KV_SCALE_BYTES
from kiln.plugins.attention import causal_attention, causal_attention_paged
from kiln.plugins.kv_quant import from_pool, is_quantized, to_pool, writable
from kiln.plugins.native import define_native_op

__all__ = [
    "paged_attention", "paged_attention_reference", "write_kv", "paged_attention_functional", "kv_cache_update",
    "token_layout", "softcap_scores",
]


def check_pool(kv_cache: torch.Tensor, head_dim: int) -> None:
    """ValueError unless ``kv_cache`` is a pool of rows of ``head_dim`` values (+ the scale of an 8-bit pool)."""
    row = head_dim + KV_SCALE_BYTES if is_quantized(kv_cache.dtype) else head_dim
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or kv_cache.shape[5] != row:
        raise ValueError(f"kv_cache {kv_cache.dtype} {list(kv_cache.shape)} is not a pool of rows of {row} "
                         f"{'(head_dim + 2 scale bytes)' if row != head_dim else '(head_dim)'} for head_dim "
                         f"{head_dim}: [layers, 2, blocks, block_size, kv_heads, {row}]")


def write_kv(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the new keys/values of this step into the pool slots they own (quantized for an 8-bit pool)."""
    check_pool(kv_cache, k.shape[-1])
    _, _, num_blocks, block_size, num_kv_heads, row = kv_cache.shape
    flat = writable(kv_cache[layer]).view(2, num_blocks * block_size, num_kv_heads, row)
    flat[0].index_copy_(0, slot_mapping, writable(to_pool(k, kv_cache.dtype)))
    flat[1].index_copy_(0, slot_mapping, writable(to_pool(v, kv_cache.dtype)))


def _gather_context(
    pool: torch.Tensor, block_tables: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """[S, num_blocks*block_size, Hkv, D] view of the first ``num_blocks`` blocks of each sequence."""
    gathered = pool[block_tables[:, :num_blocks].long()]  # [S, nb, bs, H, D]
    s, nb, bs, h, d = gathered.shape
    return gathered.view(s, nb * bs, h, d)


def softcap_scores(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Attention-logit soft-capping (Gemma 2): ``cap * tanh(scores / cap)``; ``softcap`` 0 leaves them."""
    return torch.tanh(scores / softcap) * softcap if softcap > 0 else scores


def _sdpa(q, k, v, mask, scale: float, softcap: float):
    """SDPA, or its definition in fp32 with the scores soft-capped (SDPA has no soft-capping)."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = softcap_scores((q.float() @ k.float().transpose(-1, -2)) * scale, softcap)
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (weights @ v.float()).to(q.dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float = 0.0
) -> torch.Tensor:
    """Masked attention with GQA. q [B, Hq, M, D], k/v [B, Hkv, N, D], mask [B, 1, M, N] bool (True = attend).

    Query head h reads kv head h // group, with no copy of the kv heads: SDPA's own GQA where its kernel
    runs (several queries, no soft-capping: the mask broadcasts over the heads), else the group's query heads
    become extra query rows of their kv head, [B, Hkv, group*M, D] (one query needs no repeated mask).
    """
    b, hq, m, d = q.shape
    hkv = k.shape[1]
    if hq == hkv:
        return _sdpa(q, k, v, mask, scale, softcap)
    if m > 1 and softcap <= 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = hq // hkv
    q = q.reshape(b, hkv, group * m, d)  # row g*M + i = query i of head kv*group + g
    if m > 1:
        mask = mask.repeat(1, 1, group, 1)
    out = _sdpa(q, k, v, mask, scale, softcap)
    return out.reshape(b, hq, m, d)


def _decode_batch(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    """All one-token sequences at once: q [N, Hq, D] -> [N, Hq, D]."""
    block_size = k_pool.shape[1]
    max_ctx = int(context_lens.max())
    nb = (max_ctx + block_size - 1) // block_size
    keys = _gather_context(k_pool, block_tables, nb).transpose(1, 2)  # [N, H, ctx, D]
    values = _gather_context(v_pool, block_tables, nb).transpose(1, 2)
    pos = torch.arange(nb * block_size)
    ctx = context_lens.long().unsqueeze(1)
    mask = pos.unsqueeze(0) < ctx  # query sits at position ctx-1
    if sliding_window > 0:
        mask &= pos.unsqueeze(0) > ctx - 1 - sliding_window
    # Shorter sequences gather slots they never wrote (the tail of their last block, padded table
    # entries). Whatever those hold (stale or uninitialised memory, possibly NaN) must not leak in:
    # a masked score still multiplies its value, and NaN * 0 is NaN.
    keep = mask[:, None, :, None]
    zero = torch.zeros((), dtype=q.dtype)
    keys = torch.where(keep, from_pool(keys, q.dtype), zero)
    values = torch.where(keep, from_pool(values, q.dtype), zero)
    out = _attend(q.unsqueeze(2), keys, values, mask[:, None, None, :], scale, softcap)
    return out.squeeze(2)


def _context_one(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    context_len: int,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence with n new tokens at the end of context_len: q [n, Hq, D] -> [n, Hq, D] (into ``out`` where
    kiln's kernel runs, else a new tensor)."""
    n = q.shape[0]
    plain_causal = softcap <= 0 and (sliding_window <= 0 or context_len <= sliding_window)
    if plain_causal:   # a pool in q's dtype: the kernel reads its keys and values where they are
        done = causal_attention_paged(q, k_pool, v_pool, block_table, context_len, scale, out)
        if done is not None:
            return done
    block_size = k_pool.shape[1]
    nb = (context_len + block_size - 1) // block_size
    # [H, ctx, D] in q's dtype, dequantized once (an 8-bit pool) for whichever attention below runs
    keys = from_pool(_gather_context(k_pool, block_table[None], nb)[0, :context_len], q.dtype).transpose(0, 1)
    values = from_pool(_gather_context(v_pool, block_table[None], nb)[0, :context_len], q.dtype).transpose(0, 1)
    if plain_causal:
        done = causal_attention(q, keys.transpose(0, 1), values.transpose(0, 1), scale, out)
        if done is not None:
            return done
    if context_len == n and plain_causal:
        # A whole prompt (no cached prefix) is plain causal attention: SDPA's causal kernel skips the masked half
        # and builds no [n, n] mask (2.5x faster at 2k tokens than the masked call below).
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], is_causal=True,
                                             scale=scale, enable_gqa=q.shape[1] != keys.shape[0])
        return out[0].transpose(0, 1)
    q_pos = torch.arange(context_len - n, context_len).unsqueeze(1)
    k_pos = torch.arange(context_len).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window > 0:
        mask &= k_pos > q_pos - sliding_window
    out = _attend(q.transpose(0, 1)[None], keys[None], values[None], mask[None, None], scale, softcap)
    return out[0].transpose(0, 1)


def _context_sequences(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
    min_len: int = 2,
) -> None:
    """Rows of the context sequences (``min_len`` new tokens or more) into ``out``, one SDPA call each."""
    k_pool, v_pool = kv_cache[layer, 0], kv_cache[layer, 1]
    lens = seq_lens.tolist()
    ctx_lens = context_lens.tolist()
    s = 0
    for i, n in enumerate(lens):
        if n >= min_len:
            rows = out[s : s + n]
            got = _context_one(q[s : s + n], k_pool, v_pool, ctx_lens[i], block_tables[i], scale, sliding_window,
                               softcap, rows)
            if got is not rows:
                rows.copy_(got)
        s += n


def _paged_attention_py(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Plain-torch kernel (the fallback): decode sequences as one batch, context ones one by one."""
    write_kv(kv_cache, layer, k, v, slot_mapping)
    k_pool, v_pool = kv_cache[layer, 0], kv_cache[layer, 1]
    out = torch.empty_like(q)
    lens = seq_lens.tolist()
    starts = [0] * len(lens)
    for i in range(1, len(lens)):
        starts[i] = starts[i - 1] + lens[i - 1]
    decode = [i for i, n in enumerate(lens) if n == 1]
    if decode:
        idx = torch.tensor(decode)
        rows = torch.tensor([starts[i] for i in decode])
        out[rows] = _decode_batch(
            q[rows], k_pool, v_pool, context_lens[idx], block_tables[idx], scale, sliding_window, softcap
        )
    if any(n > 1 for n in lens):
        _context_sequences(q, kv_cache, layer, seq_lens, context_lens, block_tables, out, scale, sliding_window,
                           softcap)
    return out


# softcap: attention-logit soft-capping, 0 = off (a default, so graphs exported before it existed still load)
_PA_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor(a3!) kv_cache, SymInt layer, Tensor seq_lens, Tensor context_lens, "
    "Tensor block_tables, Tensor slot_mapping, float scale, SymInt sliding_window, float softcap=0.0) -> Tensor"
)
_lib = torch.library.Library("kiln", "FRAGMENT")
define_native_op(_lib, "paged_attention", _PA_SCHEMA, _paged_attention_py, lambda q, *args: torch.empty_like(q))
# called by the C++ kernel for the context sequences of a mixed batch (not part of any graph)
_lib.define(
    "_paged_attention_context_py(Tensor q, Tensor kv_cache, int layer, Tensor seq_lens, Tensor context_lens, "
    "Tensor block_tables, Tensor(a!) out, float scale, int sliding_window, float softcap, int min_len=2) -> ()"
)
_lib.impl("_paged_attention_context_py", _context_sequences, "CompositeExplicitAutograd")


# The Python entry point is the op itself (its schema is _PA_SCHEMA; see the module docstring).
paged_attention = torch.ops.kiln.paged_attention


def paged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Token-by-token attention in plain torch: the definition the kernel is tested against (an 8-bit pool:
    each row quantized as it is written, every context row dequantized in float32 as it is read)."""
    check_pool(kv_cache, q.shape[-1])
    block_size = kv_cache.shape[3]
    num_kv_heads = kv_cache.shape[4]
    group = q.shape[1] // num_kv_heads
    for t in range(q.shape[0]):
        slot = int(slot_mapping[t])
        writable(kv_cache)[layer, 0, slot // block_size, slot % block_size] = writable(to_pool(k[t], kv_cache.dtype))
        writable(kv_cache)[layer, 1, slot // block_size, slot % block_size] = writable(to_pool(v[t], kv_cache.dtype))
    out = torch.zeros_like(q)
    t = 0
    for s in range(seq_lens.shape[0]):
        n, ctx = int(seq_lens[s]), int(context_lens[s])
        slots = [(int(block_tables[s, j // block_size]), j % block_size) for j in range(ctx)]
        keys = from_pool(torch.stack([kv_cache[layer, 0, b, o] for b, o in slots]), torch.float32)
        values = from_pool(torch.stack([kv_cache[layer, 1, b, o] for b, o in slots]), torch.float32)
        for i in range(n):
            pos = ctx - n + i
            lo = max(0, pos - sliding_window + 1) if sliding_window > 0 else 0
            for h in range(q.shape[1]):
                kh = keys[lo : pos + 1, h // group]
                vh = values[lo : pos + 1, h // group]
                scores = kh @ q[t + i, h].float() * scale
                if softcap > 0:
                    scores = softcap * torch.tanh(scores / softcap)
                weights = torch.softmax(scores, dim=0)
                out[t + i, h] = (weights @ vh).to(q.dtype)
        t += n
    return out


# ---------------------------------------------------------------------------------------------------------
# The functional form, for backends whose graphs cannot write an input in place (onnx, tensorrt): attention
# reads the pool as it was before the step plus this step's keys/values, and one ``kv_cache_update`` at the
# end of the graph returns the pool with every layer's new keys/values written (the builder's functional_kv
# pass rewrites ``paged_attention`` into these). Their ONNX lowering is ``paged_attention_onnx``; the torch
# implementations below compute the same formulation with the same tensors, so that the formulation is
# tested against ``paged_attention_reference`` in torch and its lowering against both.


def token_layout(seq_lens: torch.Tensor, context_lens: torch.Tensor, num_tokens: int, width: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each packed token and each gathered context slot belongs, from the step's shapes alone
    (no data-dependent shape, so that the graph has the contract's dims only).

    ``width`` is the context slots gathered per sequence (block table width x block size). Returns
    (seq_of_token [T], position [T] (absolute), seq_of_slot [S*width], slot_position [S*width]).
    """
    lens = seq_lens.long()
    ends = torch.cumsum(lens, 0)
    tok = torch.arange(num_tokens)
    seq_of = (tok[:, None] >= ends[None, :]).sum(1)
    pos = context_lens.long()[seq_of] - ends[seq_of] + tok
    slots = torch.arange(seq_lens.shape[0] * width)
    return seq_of, pos, slots // width, slots % width


def _paged_attention_functional(q, k, v, kv_cache, layer, seq_lens, context_lens, block_tables, slot_mapping,
                                scale, sliding_window, softcap=0.0):
    """Attention of every packed token over its sequence's context, as one masked product.

    Each sequence's context is gathered through its block table ([S * width] slots), this step's keys and
    values are put at their positions in that copy (not in the pool), and every token attends to every
    gathered slot under a token-level mask: same sequence, causal with the context offset, inside the
    sliding window. Slots a sequence never wrote are zeroed (NaN * 0 is NaN). The score matrix is
    [Hq, T, S * width]: no loop over sequences, shapes from the inputs' dims alone.
    """
    t, hq, d = q.shape
    _, _, _, block_size, hkv, row = kv_cache.shape
    s, mb = block_tables.shape
    width = mb * block_size
    group = hq // hkv
    seq_of, pos, slot_seq, slot_pos = token_layout(seq_lens, context_lens, t, width)
    rows = seq_of * width + pos
    gathered = kv_cache[layer][:, block_tables.long()].reshape(2, s * width, hkv, row)
    keys = writable(gathered[0]).index_put((rows,), writable(to_pool(k, kv_cache.dtype))).view(kv_cache.dtype)
    values = writable(gathered[1]).index_put((rows,), writable(to_pool(v, kv_cache.dtype))).view(kv_cache.dtype)
    keys, values = from_pool(keys, torch.float32), from_pool(values, torch.float32)
    written = slot_pos < context_lens.long()[slot_seq]
    values = torch.where(written[:, None, None], values, 0.0)
    mask = (slot_seq[None, :] == seq_of[:, None]) & (slot_pos[None, :] <= pos[:, None])
    if sliding_window > 0:
        mask &= slot_pos[None, :] > pos[:, None] - sliding_window
    qh = q.float().reshape(t, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, t * group, d)
    scores = softcap_scores(qh @ keys.permute(1, 2, 0) * scale, softcap)   # [Hkv, T*group, S*width]
    scores = torch.where(mask.repeat_interleave(group, 0), scores, float("-inf"))
    out = torch.softmax(scores, -1) @ values.transpose(0, 1)          # [Hkv, T*group, D]
    return out.reshape(hkv, t, group, d).permute(1, 0, 2, 3).reshape(t, hq, d).to(q.dtype)


def _kv_cache_update(kv_cache, keys, values, slot_mapping):
    """A copy of the pool with layer l's ``keys[l]``/``values[l]`` [T, Hkv, D] at ``slot_mapping``."""
    out = kv_cache.clone()
    for layer, (k, v) in enumerate(zip(keys, values)):
        write_kv(out, layer, k, v, slot_mapping)
    return out


_lib.define(
    "paged_attention_functional(Tensor q, Tensor k, Tensor v, Tensor kv_cache, SymInt layer, Tensor seq_lens, "
    "Tensor context_lens, Tensor block_tables, Tensor slot_mapping, float scale, SymInt sliding_window, "
    "float softcap=0.0) -> Tensor"
)
_lib.impl("paged_attention_functional", _paged_attention_functional, "CompositeExplicitAutograd")
torch.library.register_fake("kiln::paged_attention_functional", lambda q, *args: torch.empty_like(q), lib=_lib)
_lib.define("kv_cache_update(Tensor kv_cache, Tensor[] keys, Tensor[] values, Tensor slot_mapping) -> Tensor")
_lib.impl("kv_cache_update", _kv_cache_update, "CompositeExplicitAutograd")
torch.library.register_fake("kiln::kv_cache_update", lambda kv_cache, *args: torch.empty_like(kv_cache), lib=_lib)

paged_attention_functional = torch.ops.kiln.paged_attention_functional
kv_cache_update = torch.ops.kiln.kv_cache_update
