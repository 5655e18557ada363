"""kiln::lora against its plain-torch reference: the C++ kernel and the torch fallback, fp32 and bf16, tokens of
many adapters and none in one batch, merged GEMMs (several segments, a shared A, a column range of a wider B),
NaN in slots no token uses, argument errors, and the op under torch.export."""

from __future__ import annotations

import pytest
import torch

import kiln.plugins  # noqa: F401
from kiln.plugins.lora import _lora_py, lora_reference
from kiln.plugins.native import native_kernels_disabled

RANK = 4
K = 40
NUMEL = 4000
# q (24 cols) and v (16 cols, its B^T read from a 40-wide block) of a merged [T, 48] output, and a third segment
# sharing v's A with another column range of that block; columns 28..31 have no adapter
SEGMENTS = [0, 160, 24, 0, 24,   500, 800, 40, 32, 16,   500, 816, 40, 24, 4]
UNCOVERED = slice(28, 32)


def case(dtype, tokens=9, slots=(0, -1, 2, 0, 1, -1, 2, 2, 0), seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, NUMEL, generator=g).to(dtype)
    x = torch.randn(tokens, K, generator=g).to(dtype)
    y = torch.randn(tokens, 48, generator=g).to(dtype)
    return y, x, torch.tensor(slots, dtype=torch.int32), w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_fallback_match_reference(native, dtype):
    y, x, slots, w = case(dtype)
    ref = lora_reference(y, x, slots, w, SEGMENTS, RANK)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=0.02)
    got = torch.ops.kiln.lora(y, x, slots, w, SEGMENTS, RANK)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(_lora_py(y, x, slots, w, SEGMENTS, RANK), ref, **tol)
    with native_kernels_disabled():
        torch.testing.assert_close(torch.ops.kiln.lora(y, x, slots, w, SEGMENTS, RANK), ref, **tol)
    base = slots < 0
    assert torch.equal(got[base], y[base])                 # tokens without an adapter: y as it is
    assert (got[~base] - y[~base]).abs().amax() > 0.5      # the others changed
    assert torch.equal(got[:, UNCOVERED], y[:, UNCOVERED])  # and only in their segments' columns


def test_the_delta_is_each_tokens_own_adapter(native):
    y, x, slots, w = case(torch.float32)
    got = torch.ops.kiln.lora(y, x, slots, w, SEGMENTS, RANK)
    for t in range(x.shape[0]):   # one token at a time through the same op: equal to its row in the batch
        alone = torch.ops.kiln.lora(y[t:t + 1], x[t:t + 1], slots[t:t + 1], w, SEGMENTS, RANK)
        torch.testing.assert_close(alone[0], got[t], atol=1e-6, rtol=1e-6)


def test_slots_no_token_uses_are_never_read(native):
    y, x, slots, w = case(torch.float32, slots=(0, -1, 0, 2, -1, 2, 0, 0, 2))
    w[1] = float("nan")
    got = torch.ops.kiln.lora(y, x, slots, w, SEGMENTS, RANK)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, lora_reference(y, x, slots, w, SEGMENTS, RANK), atol=1e-5, rtol=1e-5)


def test_decode_shape_many_adapters(native):
    """A batch-16 decode step with 4 adapters and base rows, on a merged q/k/v of realistic widths."""
    g = torch.Generator().manual_seed(3)
    k, rank, q, kv = 256, 16, 256, 64
    numel = 3 * rank * (k + q)
    w = torch.randn(5, numel, generator=g) * 0.1
    x, y = torch.randn(16, k, generator=g), torch.randn(16, q + 2 * kv, generator=g)
    slots = torch.tensor([i % 5 - 1 for i in range(16)], dtype=torch.int32)
    segs, off = [], 0
    for col, n in ((0, q), (q, kv), (q + kv, kv)):
        segs += [off, off + rank * k, n, col, n]
        off += rank * (k + q)
    torch.testing.assert_close(torch.ops.kiln.lora(y, x, slots, w, segs, rank),
                               lora_reference(y, x, slots, w, segs, rank), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change, message", [
    (dict(slots=torch.tensor([0, 3], dtype=torch.int32)), "slots holds 3, outside the adapter pool's slots [0, 3)"),
    (dict(slots=torch.tensor([0, -2], dtype=torch.int32)), "slots holds -2"),
    (dict(slots=torch.tensor([0, 1], dtype=torch.int64)), "slots must be int32 [2]"),
    (dict(slots=torch.tensor([0], dtype=torch.int32)), "slots must be int32 [2]"),
    (dict(segments=[0, 160, 24, 40, 24]), "does not fit an adapter row of 4000 elements and y's 48 columns"),
    (dict(segments=[3900, 160, 24, 0, 24]), "does not fit"),
    (dict(segments=[0, 160, 24, 0]), "5-int records"),
    (dict(weights=torch.zeros(3, NUMEL, dtype=torch.bfloat16)), "the adapter pool must be [slots, numel] of y's"),
    (dict(x=torch.zeros(3, K)), "must be [tokens, features] with the same number of tokens"),
])
def test_argument_errors_name_the_problem(native, change, message):
    y, x, slots, w = case(torch.float32, tokens=2, slots=(0, 1))
    args = dict(y=y, x=x, slots=slots, weights=w, segments=SEGMENTS[:5], rank=RANK)
    args.update(change)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        torch.ops.kiln.lora(args["y"], args["x"], args["slots"], args["weights"], args["segments"], args["rank"])


def test_the_op_exports_with_dynamic_tokens_and_slots():
    from torch.export import Dim

    class M(torch.nn.Module):
        def forward(self, y, x, slots, weights):
            return torch.ops.kiln.lora(y, x, slots, weights, SEGMENTS, RANK)

    y, x, slots, w = case(torch.float32)
    tokens, loras = Dim("num_tokens", min=1, max=64), Dim("max_loras", min=1)
    ep = torch.export.export(M(), (y, x, slots, w), dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}, {0: loras}),
                             strict=False)
    y2, x2, slots2, w2 = case(torch.float32, tokens=3, slots=(1, 0, -1), seed=1)
    w2 = torch.cat([w2, w2[:1]])   # 4 slots
    torch.testing.assert_close(ep.module()(y2, x2, slots2, w2), lora_reference(y2, x2, slots2, w2, SEGMENTS, RANK),
                               atol=1e-5, rtol=1e-5)
