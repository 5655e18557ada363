"""kiln::weight_only_linear / bf16_linear / fp32_linear: native AVX2 kernels vs the plain-torch reference,
the int4 layout, quantisation error bounds, the fallback path, and torch.export with a dynamic T."""

from __future__ import annotations

import os

import pytest
import torch

from kiln.plugins import linear
from kiln.plugins import native as native_lib
from kiln.plugins import weight_format as fmt

ops = torch.ops.kiln

SHAPES = [(37, 128), (64, 200), (130, 256), (8, 8), (5, 1000)]  # (out, in): odd/even, tails
MS = [1, 3, 5, 16, 64]


def _tol(ref: torch.Tensor, dtype: torch.dtype, int_act: bool = False) -> dict:
    """bf16 outputs: ~1 bf16 ulp. fp32: accumulation-order noise, plus (int8/int4) the int16
    quantisation of x (<= max|x|/65534 per element) that the integer GEMV kernels use."""
    scale = ref.float().abs().max().item() + 1e-6
    if dtype == torch.bfloat16:
        return dict(atol=scale * 1.6e-2, rtol=1.6e-2)
    if int_act:
        return dict(atol=scale * 1e-4 + 1e-6, rtol=1e-4)
    return dict(atol=scale * 2e-6 + 1e-6, rtol=1e-5)


def _assert_native_used(wtype, x, w, scales, bias, gs, n, k):
    y = linear._native(wtype, x, w, scales, bias, gs, n, k)
    assert y is not None, "the native kernel declined this case"
    return y


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_matches_reference(native, m, n, k, dtype, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    q, s = fmt.quantize_int8(w)
    ref = linear.weight_only_linear_reference(x, q, s, bias, 8, 0)
    _assert_native_used("int8", x, q, s, bias, 0, n, k)
    y = ops.weight_only_linear(x, q, s, bias, 8, 0)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, ref, **_tol(ref, dtype, int_act=True))


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k,gs", [(37, 128, 32), (64, 192, 64), (130, 256, 128), (3, 64, 16), (33, 512, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_matches_reference(native, m, n, k, gs, dtype, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k + gs)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    q, s = fmt.quantize_int4(w, gs)
    ref = linear.weight_only_linear_reference(x, q, s, bias, 4, gs)
    _assert_native_used("int4", x, q, s, bias, gs, n, k)
    y = ops.weight_only_linear(x, q, s, bias, 4, gs)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, ref, **_tol(ref, dtype, int_act=True))


@pytest.mark.parametrize("n,k,gs", [(10, 200, 40), (7, 66, 66), (4, 96, 32)])
def test_int4_shapes_outside_the_fast_kernel_still_correct(n, k, gs):
    """in % 64 != 0 (or odd group sizes): the op falls back to the torch path, same result."""
    w = torch.randn(n, k)
    x = torch.randn(3, k)
    q, s = fmt.quantize_int4(w, gs)
    ref = linear.weight_only_linear_reference(x, q, s, None, 4, gs)
    torch.testing.assert_close(ops.weight_only_linear(x, q, s, None, 4, gs), ref, **_tol(ref, torch.float32, True))


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_matches_reference(native, m, n, k, dtype, with_bias):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    ref = linear.bf16_linear_reference(x, w, bias)
    _assert_native_used("bf16", x, w, None, bias, 0, n, k)
    y = ops.bf16_linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, ref, **_tol(ref, dtype))


@pytest.mark.parametrize("path", ["sgemm", "chunked"])
def test_large_m_paths(native, monkeypatch, request, path):
    """M above kernel_max_m: dequantised row chunks + torch sgemm; M > 64: kernels on 64-row chunks."""
    if path == "sgemm":
        for kind in ("bf16", "int8", "int4"):
            old = linear.set_kernel_max_m(kind, 2)
            request.addfinalizer(lambda kind=kind, old=old: linear.set_kernel_max_m(kind, old))
        monkeypatch.setattr(linear, "_PREFILL_CHUNK_BYTES", 4 * 128 * 16)  # several row chunks
        m = 9
    else:
        m = 150
    n, k, gs = 70, 128, 32
    w = torch.randn(n, k)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    q8, s8 = fmt.quantize_int8(w)
    q4, s4 = fmt.quantize_int4(w, gs)
    wb = w.bfloat16()
    for y, ref in [
        (ops.weight_only_linear(x, q8, s8, bias, 8, 0), linear.weight_only_linear_reference(x, q8, s8, bias, 8, 0)),
        (ops.weight_only_linear(x, q4, s4, bias, 4, gs), linear.weight_only_linear_reference(x, q4, s4, bias, 4, gs)),
        (ops.bf16_linear(x, wb, bias), linear.bf16_linear_reference(x, wb, bias)),
        (ops.bf16_linear(x.bfloat16(), wb, None), linear.bf16_linear_reference(x.bfloat16(), wb, None)),
    ]:
        torch.testing.assert_close(y, ref, **_tol(ref, y.dtype, int_act=True))


@pytest.mark.parametrize("m", [1, 3, 16])
def test_non_finite_activations_propagate(native, m):
    """NaN/inf in x must not vanish in the int16 quantisation of the integer kernels."""
    w = torch.randn(24, 128)
    x = torch.randn(m, 128)
    x[0, 5] = float("nan")
    x[-1, 77] = float("inf") if m > 1 else float("nan")
    q8, s8 = fmt.quantize_int8(w)
    q4, s4 = fmt.quantize_int4(w, 32)
    for y, ref in [
        (ops.weight_only_linear(x, q8, s8, None, 8, 0), linear.weight_only_linear_reference(x, q8, s8, None, 8, 0)),
        (ops.weight_only_linear(x, q4, s4, None, 4, 32), linear.weight_only_linear_reference(x, q4, s4, None, 4, 32)),
        (ops.bf16_linear(x, w.bfloat16(), None), linear.bf16_linear_reference(x, w.bfloat16(), None)),
        (ops.bf16_linear(x.bfloat16(), w.bfloat16(), None),
         linear.bf16_linear_reference(x.bfloat16(), w.bfloat16(), None)),
        (ops.weight_only_linear(x.bfloat16(), q8, s8, None, 8, 0),
         linear.weight_only_linear_reference(x.bfloat16(), q8, s8, None, 8, 0)),
    ]:
        assert y.dtype == ref.dtype and torch.equal(y.isnan(), ref.isnan())
        assert torch.equal(y.isfinite(), ref.isfinite())
        fin = ref.isfinite()
        if fin.any():
            tol = _tol(ref[fin], torch.bfloat16) if y.dtype == torch.bfloat16 else dict(atol=1e-3, rtol=1e-4)
            torch.testing.assert_close(y[fin], ref[fin], **tol)


def test_fp16_activations(native):
    w = torch.randn(40, 128)
    x = torch.randn(3, 128).half()
    q, s = fmt.quantize_int8(w)
    ref = linear.weight_only_linear_reference(x, q, s, None, 8, 0)
    y = ops.weight_only_linear(x, q, s, None, 8, 0)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, ref, atol=ref.abs().max().item() * 2e-3, rtol=2e-3)


@pytest.mark.parametrize("m", MS + [130])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_linear_matches_reference(native, m, n, k, dtype):
    g = torch.Generator().manual_seed(m * 11 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    ref = linear.fp32_linear_reference(x, w, bias)
    if m <= linear.kernel_max_m("fp32"):
        _assert_native_used("fp32", x, w, None, bias, 0, n, k)
    y = ops.fp32_linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, ref, **_tol(ref, dtype))


PACKABLE_SHAPES = [(8, 16), (40, 128), (136, 1024)]  # (out, in): out % 8 == 0, in % 16 == 0


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16, 65, 130])
@pytest.mark.parametrize("n,k", PACKABLE_SHAPES)
@pytest.mark.parametrize("kind", ["bf16", "fp32", "int8"])
def test_packed_weights_match_plain(native, m, n, k, kind):
    """Weights packed in 8-row tiles (what the builder stores) give the plain layout's results:
    the same products summed in the same order, so bitwise equal, where both layouts take the same
    path (M <= 8 GEMV passes, buffered kernel above, M > 64 chunks / dequantised sgemm for bf16);
    packed bf16 at M = 9..16 runs GEMV passes (another summation order)."""
    g = torch.Generator().manual_seed(m * 13 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    if kind == "int8":
        q, scales = fmt.quantize_int8(w)
        wtype, int_act = "int8_packed", True
        op = lambda x, w, b: ops.weight_only_linear(x, w, scales, b, 8, 0)  # noqa: E731
        reference = lambda x, w, b: linear.weight_only_linear_reference(x, w, scales, b, 8, 0)  # noqa: E731
    else:
        q, scales = w.to(torch.bfloat16 if kind == "bf16" else torch.float32), None
        wtype, int_act = ("bf16_packed" if kind == "bf16" else "fp32_packed"), False
        op = ops.bf16_linear if kind == "bf16" else ops.fp32_linear
        reference = linear.float_linear_reference
    p = fmt.pack_rows(q)
    assert p.shape == (n // 8, k // 16, 8, 16) and p.dtype == q.dtype and torch.equal(fmt.unpack_rows(p), q)
    assert p[n // 8 - 1, 0, 3, 5] == q[n - 8 + 3, 5]
    if m <= linear.kernel_max_m(kind):
        _assert_native_used(wtype, x, p, scales, bias, 0, n, k)
    y = op(x, p, bias)
    assert y.shape == (m, n)
    ref = reference(x, q, bias)
    if kind == "bf16" and 8 < m <= 16:  # packed bf16 runs the GEMV passes here, plain rows the buffered kernel
        torch.testing.assert_close(y, op(x, q, bias), **_tol(ref, torch.float32))
    else:
        assert torch.equal(y, op(x, q, bias))
    torch.testing.assert_close(y, ref, **_tol(ref, torch.float32, int_act))
    torch.testing.assert_close(reference(x, p, bias), ref, atol=0, rtol=0)
    yb = op(x.bfloat16(), p, None)  # bf16 activations (widened and rounded in the kernel), no bias
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, op(x.bfloat16().float(), p, None).bfloat16())  # torch's rounding, bit for bit
    refb = reference(x.bfloat16(), q, None)
    torch.testing.assert_close(yb, refb, **_tol(refb, torch.bfloat16))


def test_packed_weight_errors(native):
    with pytest.raises(ValueError, match="out % 8 == 0 and in % 16 == 0"):
        fmt.pack_rows(torch.randn(12, 32))
    with pytest.raises(ValueError, match="out % 8 == 0 and in % 16 == 0"):
        fmt.pack_rows(torch.randn(16, 40))
    p = fmt.pack_rows(torch.randn(16, 48))
    with pytest.raises(ValueError, match=r"\(48 input features\)"):
        ops.fp32_linear(torch.randn(2, 32), p, None)
    with pytest.raises(ValueError, match=r"packed \[out/8, in/16, 8, 16\]"):
        ops.fp32_linear(torch.randn(2, 48), p.reshape(2, 3, 16, 8), None)
    x = torch.randn(3, 48)
    with native_lib.native_kernels_disabled():  # the plain-torch path understands the layout too
        y = ops.fp32_linear(x, p, None)
    torch.testing.assert_close(y, x @ fmt.unpack_rows(p).t())
    q, s = fmt.quantize_int8(torch.randn(16, 48))
    with pytest.raises(ValueError, match=r"scales \[16\]"):
        ops.weight_only_linear(x, fmt.pack_rows(q), s[:8], None, 8, 0)
    with pytest.raises(ValueError, match=r"bits=4 expects a packed uint8 qweight \[out, in//2\]"):
        ops.weight_only_linear(x, fmt.pack_rows(q).view(torch.uint8), s, None, 4, 16)


def test_leading_dims_and_noncontiguous_inputs(native):
    w = torch.randn(48, 128)
    x = torch.randn(2, 3, 256)[..., ::2]  # [2, 3, 128], non-contiguous
    q, s = fmt.quantize_int8(w)
    y = ops.weight_only_linear(x, q, s, None, 8, 0)
    assert y.shape == (2, 3, 48)
    ref = linear.weight_only_linear_reference(x, q, s, None, 8, 0)
    torch.testing.assert_close(y, ref, **_tol(ref, torch.float32, int_act=True))
    wb = torch.randn(128, 48).bfloat16().t()  # non-contiguous weight
    torch.testing.assert_close(ops.bf16_linear(x, wb, None), linear.bf16_linear_reference(x, wb, None),
                               atol=1e-4, rtol=1e-5)
    # the panel layouts' decode paths shape their output from x without reshaping it: 1, 2 and 3 leading dims
    p4 = fmt.quantize_int4_panels(w, 32)
    for xi in (x, x[0, 1], x[:, :1]):
        y4 = ops.weight_only_linear(xi, p4.qweight, p4.scales, None, 4, 32)
        assert y4.shape == (*xi.shape[:-1], 48) and y4.is_contiguous()
        ref4 = linear.weight_only_linear_reference(xi, p4.qweight, p4.scales, None, 4, 32)
        torch.testing.assert_close(y4, ref4, **_tol(ref4, torch.float32, int_act=True))
    yp = ops.fp32_linear(x, fmt.pack_panels(w), None)
    assert yp.shape == (2, 3, 48) and yp.is_contiguous()
    torch.testing.assert_close(yp, x @ w.t(), atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# quantisation and layout


@pytest.mark.parametrize("k", [2, 62, 64, 66, 128, 130, 320])
def test_int4_pack_round_trip(k):
    q = torch.randint(-8, 8, (5, k), dtype=torch.int8)
    packed = fmt.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, k // 2)
    assert torch.equal(fmt.unpack_int4(packed), q)


def test_int4_layout_is_the_documented_one():
    # element 64*b + 16*j + l is nibble j of little-endian 16-bit word l of block b
    k = 128
    q = torch.zeros(1, k, dtype=torch.int8)
    for b, j, lane, v in [(0, 0, 0, 1), (0, 3, 3, -8), (1, 2, 15, 5), (1, 1, 9, -1)]:
        q[0, 64 * b + 16 * j + lane] = v
    words = fmt.pack_int4(q).view(torch.int16).view(-1).tolist()  # little-endian machine

    def nib(b, lane, j):
        return ((words[16 * b + lane] >> (4 * j)) & 0xF)

    assert nib(0, 0, 0) == 1 and nib(0, 3, 3) == 8 and nib(1, 15, 2) == 5 and nib(1, 9, 1) == 0xF
    assert sum(1 for w in words if w) == 4


def test_int8_quantization_error_bound():
    w = torch.randn(64, 300) * torch.logspace(-3, 1, 64)[:, None]
    w[5] = 0.0
    q, s = fmt.quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (64,)
    assert q.abs().max() <= 127
    err = (fmt.dequantize(q, s, 8, 0) - w).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(q[5], torch.zeros_like(q[5]))
    rel = err.norm() / w.norm()
    assert rel < 0.01


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_int4_quantization_error_bound(gs):
    w = torch.randn(48, 256)
    w[3, :gs] = 0.0
    packed, s = fmt.quantize_int4(w, gs)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 128)
    assert s.dtype == torch.float32 and s.shape == (48, 256 // gs)
    q = fmt.unpack_int4(packed)
    assert q.min() >= -8 and q.max() <= 7
    deq = fmt.dequantize(packed, s, 4, gs)
    err = (deq - w).abs().reshape(48, -1, gs)
    bound = s.abs()[..., None]
    assert (err <= bound * (1 + 1e-5) + 1e-12).all()          # worst case (clamp of +8 to 7)
    assert (err.mean(-1) <= bound.squeeze(-1) * 0.4).all()    # typical: ~|s|/4
    assert (err.mean(-1) / bound.squeeze(-1).clamp_min(1e-12)).mean() < 0.3
    # the element of largest magnitude of each group is exact (it maps to -8)
    wg = w.reshape(48, -1, gs)
    idx = wg.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(deq.reshape(48, -1, gs).gather(-1, idx), wg.gather(-1, idx))
    assert (deq[3, :gs] == 0).all()
    assert (deq - w).norm() / w.norm() < 0.12


def test_int4_rejects_bad_group_size():
    w = torch.randn(4, 96)
    with pytest.raises(ValueError, match="multiple of group_size"):
        fmt.quantize_int4(w, 64)
    with pytest.raises(ValueError, match="positive"):
        fmt.quantize_int4(w, 0)
    with pytest.raises(ValueError, match="bits"):
        ops.weight_only_linear(torch.randn(1, 96), torch.zeros(4, 96, dtype=torch.int8), torch.ones(4), None, 3, 0)


# ---------------------------------------------------------------------------------------------
# fallback


def test_forced_fallback_matches_reference():
    g = torch.Generator().manual_seed(5)   # not the global generator: the same numbers whatever ran before
    w = torch.randn(40, 128, generator=g)
    x = torch.randn(3, 128, generator=g)
    q8, s8 = fmt.quantize_int8(w)
    q4, s4 = fmt.quantize_int4(w, 32)
    with native_lib.native_kernels_disabled():
        assert linear._native("int8", x, q8, s8, None, 0, 40, 128) is None
        torch.testing.assert_close(ops.weight_only_linear(x, q8, s8, None, 8, 0),
                                   linear.weight_only_linear_reference(x, q8, s8, None, 8, 0))
        torch.testing.assert_close(ops.weight_only_linear(x, q4, s4, None, 4, 32),
                                   linear.weight_only_linear_reference(x, q4, s4, None, 4, 32))
        wb = w.bfloat16()
        torch.testing.assert_close(ops.bf16_linear(x.bfloat16(), wb, None),
                                   linear.bf16_linear_reference(x.bfloat16(), wb, None))
        torch.testing.assert_close(ops.fp32_linear(x, w, None), linear.fp32_linear_reference(x, w, None))


# ---------------------------------------------------------------------------------------------
# export


class _TinyMLP(torch.nn.Module):
    def __init__(self, k=128, h=192, gs=64):
        super().__init__()
        w1, w2, w3 = torch.randn(h, k), torch.randn(h, k), torch.randn(k, h)
        q1, s1 = fmt.quantize_int8(w1)
        q2, s2 = fmt.quantize_int4(w2, gs)
        self.gs = gs
        self.register_buffer("q1", fmt.pack_rows(q1))  # packed, as the builder stores int8 weights
        self.register_buffer("s1", s1)
        self.register_buffer("q2", q2)
        self.register_buffer("s2", s2)
        self.register_buffer("w3", w3.bfloat16())
        self.register_buffer("b3", torch.randn(k))
        self.register_buffer("w4", fmt.pack_rows(torch.randn(64, k)))  # packed, as the builder stores it

    def forward(self, x):
        a = ops.weight_only_linear(x, self.q1, self.s1, None, 8, 0)
        b = ops.weight_only_linear(x, self.q2, self.s2, None, 4, self.gs)
        h = ops.bf16_linear(torch.nn.functional.silu(a) * b, self.w3, self.b3)
        return ops.fp32_linear(h, self.w4, None)

    def reference(self, x):
        a = linear.weight_only_linear_reference(x, self.q1, self.s1, None, 8, 0)
        b = linear.weight_only_linear_reference(x, self.q2, self.s2, None, 4, self.gs)
        h = linear.bf16_linear_reference(torch.nn.functional.silu(a) * b, self.w3, self.b3)
        return linear.fp32_linear_reference(h, self.w4, None)


def test_export_with_dynamic_tokens(native):
    mod = _TinyMLP().eval()
    t = torch.export.Dim("num_tokens", min=1, max=512)
    ep = torch.export.export(mod, (torch.randn(4, 128),), dynamic_shapes={"x": {0: t}})
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"kiln.weight_only_linear.default", "kiln.bf16_linear.default", "kiln.fp32_linear.default"} <= targets
    run = ep.module()
    for m in (1, 5, 40):
        x = torch.randn(m, 128)
        ref = mod.reference(x)
        torch.testing.assert_close(run(x), ref, **_tol(ref, torch.float32, int_act=True))
    # re-export of the exported graph (the builder re-traces graphs that contain these ops)
    ep2 = torch.export.export(run, (torch.randn(3, 128),), dynamic_shapes={"x": {0: t}})
    x = torch.randn(7, 128)
    ref = mod.reference(x)
    torch.testing.assert_close(ep2.module()(x), ref, **_tol(ref, torch.float32, int_act=True))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KILN_RUN_SLOW"),
                    reason="AOTInductor compile takes ~15-30 s; set KILN_RUN_SLOW=1")
def test_aot_inductor_package_calls_the_ops(native, tmp_path):
    mod = _TinyMLP().eval()
    t = torch.export.Dim("num_tokens", min=1, max=512)
    ep = torch.export.export(mod, (torch.randn(4, 128),), dynamic_shapes={"x": {0: t}})
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "mlp.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    for m in (1, 7, 33):
        x = torch.randn(m, 128)
        ref = mod.reference(x)
        torch.testing.assert_close(runner(x), ref, **_tol(ref, torch.float32, int_act=True))


@pytest.mark.parametrize("rows", [3, 33])  # the panel kernels, and the AMX route's row count on AMX CPUs
def test_a_bias_of_the_wrong_length_is_refused(native, rows):
    """Every layout and x dtype: a bias that is not one value per output feature is a clear error (the kernels
    read N values from it; the fallback passed it on unchecked and read past its end)."""
    w = torch.randn(32, 64)
    q, s = fmt.quantize_int8(w)
    p4 = fmt.quantize_int4_panels(w, 32)
    bad = torch.randn(5)
    for x in (torch.randn(rows, 64), torch.randn(rows, 64).bfloat16()):
        calls = [lambda: ops.bf16_linear(x, fmt.pack_panels(w.bfloat16()), bad),
                 lambda: ops.fp32_linear(x, fmt.pack_panels(w), bad),
                 lambda: ops.fp32_linear(x, w, bad),
                 lambda: ops.weight_only_linear(x, fmt.pack_panels(q), s, bad, 8, 0),
                 lambda: ops.weight_only_linear(x, q, s, bad, 8, 0),
                 lambda: ops.weight_only_linear(x, p4.qweight, p4.scales, bad, 4, 32)]
        for call in calls:
            with pytest.raises(ValueError, match=r"bias \(5,\) must be \[32\], one value per output feature"):
                call()
