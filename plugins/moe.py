"""Mixture of experts: ``kiln::moe``, the sparse MLP of Mixtral and Qwen3-MoE in one op.

``moe(x, router, gate_up, gate_up_scales, down, down_scales, top_k, renormalize, bits, group_size) -> y``:

1. router logits ``x @ router.T`` (in x's dtype, as transformers), softmax in fp32, the ``top_k`` largest
   probabilities (``torch.topk``'s choice, transformers' too); ``renormalize``: divided by their sum (Mixtral,
   Qwen3-MoE with norm_topk_prob);
2. the tokens grouped by expert; for each expert that got tokens, one gated GEMM pair over its tokens:
   ``down_e(silu(gate_e(x)) * up_e(x))`` (gate and up are one [2I, H] weight, gate rows first);
3. each token's expert outputs weighted by its router probabilities and summed in fp32 (experts in ascending
   order, as transformers adds them), cast to x's dtype.

Expert weights are stacked on a leading expert dim, each expert in one of the formats of
:mod:`kiln.plugins.linear` (what the builder's passes store): ``bits`` 0: float [E, 2I, H] / [E, H, I] or their
16-row panels (fp32 [E, N/16, K, 16], bf16 [E, N/16, K/2, 16, 2]); 8: int8, plain or panels, scales fp32 [E, N];
4: kiln's int4 nibbles [E, N, K/2], scales [E, N, K/group_size]. The router stays in the engine dtype (its choice
decides which weights are read; it is never quantized).

CPU kernel: C++ (``csrc/moe_ops.cpp``): routing and grouping with no Python, each hit expert's GEMMs through the
``kiln::*_linear`` kernels on that expert's slice of the stacked weights, so a decode step reads the weights of
the ``top_k`` chosen experts only (the bandwidth win of MoE), and a prefill runs one GEMM per expert over all of
its tokens. Without the native library (or for inputs it does not cover) ``_moe_py`` below runs the same
algorithm in torch; :func:`moe_reference` is the dense definition both are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.plugins.native import define_native_op
from kiln.plugins.weight_format import dequantize, qweight_shape, unpack

__all__ = ["moe", "moe_reference", "route", "expert_shape", "expert_weight"]

MOE_SCHEMA = ("(Tensor x, Tensor router, Tensor gate_up, Tensor? gate_up_scales, Tensor down, Tensor? down_scales, "
              "int top_k, bool renormalize, int bits, int group_size) -> Tensor")


def expert_shape(w: torch.Tensor, bits: int) -> tuple[int, int]:
    """(out, in) of each expert of a stacked weight in any of the op's formats."""
    if w.dim() < 3:
        raise ValueError(f"expert weights must be stacked [experts, out, in] (or a layout of it), got {tuple(w.shape)}")
    return qweight_shape(w[0], bits) if bits else qweight_shape(w[0], 8)


def expert_weight(w: torch.Tensor, scales: torch.Tensor | None, e: int, bits: int, group_size: int) -> torch.Tensor:
    """Expert ``e``'s weight as fp32 [out, in] (dequantized, unpacked)."""
    return dequantize(w[e], scales[e], bits, group_size) if bits else unpack(w[e]).float()


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], experts int64 [T, top_k]) of each token, as transformers' routers compute them."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _check(x, router, gate_up, gate_up_scales, down, down_scales, top_k, bits, group_size) -> int:
    """Validate the arguments (clear ValueErrors naming them); returns the experts' intermediate width I."""
    if x.dim() != 2 or router.dim() != 2 or router.shape[1] != x.shape[1]:
        raise ValueError(f"moe: x must be [tokens, hidden] and router [experts, hidden], got {tuple(x.shape)} and "
                         f"{tuple(router.shape)}")
    e, h = router.shape
    if bits not in (0, 4, 8):
        raise ValueError(f"moe: bits must be 0 (float experts), 4 or 8, got {bits}")
    if not 1 <= top_k <= e:
        raise ValueError(f"moe: top_k={top_k} must be between 1 and the {e} experts")
    n2, k1 = expert_shape(gate_up, bits)
    n1, k2 = expert_shape(down, bits)
    if gate_up.shape[0] != e or down.shape[0] != e or k1 != h or n1 != h or n2 != 2 * k2:
        raise ValueError(f"moe: {e} experts of hidden {h} need gate_up [{e}, 2I, {h}] and down [{e}, {h}, I]; got "
                         f"{gate_up.shape[0]} x {(n2, k1)} and {down.shape[0]} x {(n1, k2)}")
    for name, s, n, k in (("gate_up", gate_up_scales, n2, k1), ("down", down_scales, n1, k2)):
        want = None if not bits else (e, n) if bits == 8 else (e, n, k // max(group_size, 1))
        got = None if s is None else tuple(s.shape)
        if got != want:
            raise ValueError(f"moe: {name}_scales must be {'absent' if want is None else list(want)} for bits={bits}, "
                             f"got {got}")
    return k2


def _expert_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, bits: int, group_size: int):
    """One expert's GEMM through kiln's linear ops (their kernels, or their references)."""
    ops = torch.ops.kiln
    if bits:
        return ops.weight_only_linear(x, w, s, None, bits, group_size)
    if w.dtype == torch.float32:
        return ops.fp32_linear(x, w, None)
    if w.dtype == torch.bfloat16:
        return ops.bf16_linear(x, w, None)
    return F.linear(x, unpack(w).to(x.dtype))


def _moe_py(x, router, gate_up, gate_up_scales, down, down_scales, top_k, renormalize, bits, group_size):
    """The op's algorithm in torch (the fallback): grouped by expert, the hit experts only."""
    inter = _check(x, router, gate_up, gate_up_scales, down, down_scales, top_k, bits, group_size)
    weights, experts = route(x, router, top_k, renormalize)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(experts).tolist():   # sorted
        tokens, slot = torch.where(experts == e)
        h = _expert_linear(x[tokens], gate_up[e], None if gate_up_scales is None else gate_up_scales[e], bits,
                           group_size)
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = _expert_linear(a, down[e], None if down_scales is None else down_scales[e], bits, group_size)
        out.index_add_(0, tokens, y.float() * weights[tokens, slot, None])
    return out.to(x.dtype)


def moe_reference(x, router, gate_up, gate_up_scales, down, down_scales, top_k, renormalize, bits, group_size):
    """The dense definition: every expert on every token (weights dequantized to fp32, activations rounded to x's
    dtype between the GEMMs as the kernels do), combined with each token's router weights (0 off its top_k)."""
    inter = _check(x, router, gate_up, gate_up_scales, down, down_scales, top_k, bits, group_size)
    weights, experts = route(x, router, top_k, renormalize)
    dense = torch.zeros(x.shape[0], router.shape[0]).scatter(1, experts, weights)   # [T, E]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(router.shape[0]):
        h = (x.float() @ expert_weight(gate_up, gate_up_scales, e, bits, group_size).T).to(x.dtype)
        a = F.silu(h[:, :inter]) * h[:, inter:]
        y = (a.float() @ expert_weight(down, down_scales, e, bits, group_size).T).to(x.dtype)
        out += dense[:, e, None] * y.float()
    return out.to(x.dtype)


_lib = torch.library.Library("kiln", "FRAGMENT")
define_native_op(_lib, "moe", MOE_SCHEMA, _moe_py, lambda x, *args: torch.empty_like(x))

moe = torch.ops.kiln.moe
