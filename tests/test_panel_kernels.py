"""The panel-layout GEMM kernels (plugins/csrc/panel_kernels.h) against the plain-torch references: every
weight type, both instruction sets this CPU runs (AVX2 always, AVX-512 where present), decode and prefill
row counts, bias, bf16 activations, non-finite x, and the layout itself."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from kiln.plugins import linear
from kiln.plugins import native as native_lib
from kiln.plugins import weight_format as fmt

SHAPES = [(16, 2), (48, 34), (64, 64), (48, 96), (96, 1024), (32, 2816)]  # (out, in): one panel, odd pair counts,
# an odd panel count with K a multiple of 32 (the AMX route's single-panel tail), big K
# every micro-kernel and its tails, the one-pass batched-decode kernel (13..16 rows on AVX-512), the prefetching
# batched-decode bound (32 / 33 rows), >1 tile
ROWS = [1, 2, 3, 4, 5, 7, 12, 13, 14, 15, 16, 17, 24, 25, 32, 33, 97, 200]


@pytest.fixture(params=[256, 512])
def isa(request, native):
    if request.param == 512 and native_lib.set_panel_isa(0) != 512:
        pytest.skip("this CPU has no AVX-512 (F/BW/VL/DQ/VNNI)")
    assert native_lib.set_panel_isa(request.param) == request.param
    yield request.param
    native_lib.set_panel_isa(0)


def _rel(y, ref):
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def test_panel_layout_round_trip():
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        w = (torch.randn(48, 34) * 50).to(dtype)
        p = fmt.pack_panels(w)
        assert p.shape == ((3, 34, 16) if dtype == torch.float32 else (3, 17, 16, 2))
        assert fmt.is_panel(p) and fmt.weight_shape(p) == (48, 34) and torch.equal(fmt.unpack_panels(p), w)
        # element (n, k) where the kernels read it
        n, k = 37, 21
        flat = p.reshape(-1)
        i = ((n // 16) * 34 + k) * 16 + n % 16 if dtype == torch.float32 else \
            ((n // 16) * 17 + k // 2) * 32 + (n % 16) * 2 + k % 2
        assert flat[i] == w[n, k]
    with pytest.raises(ValueError, match="out % 16"):
        fmt.pack_panels(torch.randn(24, 32))
    with pytest.raises(ValueError, match="even in"):
        fmt.pack_panels(torch.randn(32, 33).bfloat16())


@pytest.fixture
def panel_kernels_only(native):
    """The bf16 and fp32 panel kernels at every M (no AMX routes, which AMX CPUs take from bf16_gemm_m and
    fp32_gemm_m rows)."""
    old, old32 = linear.set_bf16_gemm_m(0), linear.set_fp32_gemm_m(0)
    yield
    linear.set_bf16_gemm_m(old)
    linear.set_fp32_gemm_m(old32)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_and_bf16_panels(isa, shape, panel_kernels_only):
    n, k = shape
    torch.manual_seed(n * k)
    w, b = torch.randn(n, k) * 0.05, torch.randn(n)
    wb = w.bfloat16()
    pf, pb = fmt.pack_panels(w), fmt.pack_panels(wb)
    for m in ROWS:
        x = torch.randn(m, k)
        y = linear.fp32_linear(x, pf, b)
        assert _rel(y, x @ w.t() + b) < 1e-5, (m, "fp32")
        y = linear.fp32_linear(x.bfloat16(), pf, b)  # bf16 activations, fp32 weights: bf16 out
        ref = (x.bfloat16().float() @ w.t() + b).bfloat16()
        assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1e-2, (m, "fp32 w, bf16 x")
        y = linear.bf16_linear(x, pb, b)  # fp32 x, bf16 weights: fp32 out
        assert y.dtype == torch.float32 and _rel(y, x @ wb.float().t() + b) < 1e-5, (m, "bf16 w")
        xb = x.bfloat16()  # a bf16 engine's activations: bf16 out, rounded as torch rounds
        ref = (xb.float() @ wb.float().t() + b).bfloat16()
        y = linear.bf16_linear(xb, pb, b)
        assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1e-2, (m, "bf16 x")


@pytest.mark.parametrize("split", [0, 1])
def test_batched_decode_both_kernels(native, split):
    """13..16 rows on AVX-512 (fp32 x over fp32 or bf16 panels): either kernel of tuning().onepass_split, an odd
    panel count (the 16-row kernel whatever the choice), K not a multiple of the 64-k chunk, bias, bf16 out."""
    from kiln.plugins import tuning

    if native_lib.set_panel_isa(0) != 512:
        pytest.skip("this CPU has no AVX-512 (F/BW/VL/DQ/VNNI)")
    lib = native_lib.library()
    old = tuning.current(lib)["onepass_split"]
    tuning.set_value(lib, "onepass_split", split)
    try:
        for n, k in [(64, 1024), (48, 96), (32, 2816), (96, 40)]:
            torch.manual_seed(n + k)
            w, b = torch.randn(n, k) * 0.05, torch.randn(n)
            pf, pb = fmt.pack_panels(w), fmt.pack_panels(w.bfloat16())
            for m in (13, 14, 15, 16):
                x = torch.randn(m, k)
                assert _rel(linear.fp32_linear(x, pf, b), x @ w.t() + b) < 1e-5, (n, k, m)
                ref = x @ w.bfloat16().float().t() + b
                assert _rel(linear.bf16_linear(x, pb, b), ref) < 1e-5, (n, k, m, "bf16 w")
                y = linear.fp32_linear(x.bfloat16(), pf, b)
                assert _rel(y, (x.bfloat16().float() @ w.t() + b).bfloat16()) < 1e-2, (n, k, m, "bf16 x")
    finally:
        tuning.set_value(lib, "onepass_split", old)


@pytest.mark.parametrize("m", [1, 4, 14, 33])   # decode, batched and prefill tiles share the epilogue
def test_bf16_outputs_round_as_torch_rounds(isa, m):
    """A bf16 output is the fp32 sum rounded as torch rounds it, bit for bit: nearest, ties to even (both
    parities, both signs), carries into the exponent, overflow to inf, denormals kept, NaN as 0x7fc0. Each call's
    weight is [value, 0] in every row and each row of x is [1, 0], so every output is that value exactly."""
    bits = [0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F80FFFF, 0x3F807FFF, 0x3FFF8000, 0x7F7FFFFF,
            0xFF7FFFFF, 0x00008000, 0x00018000, 0x007FFFFF, 0x80008001, 0x7F800000, 0xFF800000, 0x7FC00000,
            0xFFC00001, 0x00000000, 0x41200000, 0x3DCCCCCD, 0x477FE000, 0x0080FFFF, 0x3F7FFFFF]
    values = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.tensor([[1.0, 0.0]]).repeat(m, 1).bfloat16()   # bf16 x: bf16 out, rounded by the epilogue
    for v in values:
        w = torch.stack([v.expand(32), torch.zeros(32)], dim=1)
        y = linear.fp32_linear(x, fmt.pack_panels(w), None)
        want = v.expand(m, 32).bfloat16()
        assert y.dtype == torch.bfloat16 and torch.equal(y.view(torch.int16), want.view(torch.int16)), hex(
            v.view(torch.int32).item() & 0xFFFFFFFF)


@pytest.mark.parametrize("k", [512, 1024, 1536])  # rows K * 4 bytes apart share L1 sets: prefill packs x per row block
def test_prefill_packing_never_reuses_another_calls_x(isa, k, panel_kernels_only):
    """The packed row blocks are kept per thread between a GEMM's tiles: the next call (same shape, same x buffer
    written in place, another weight type) must pack again."""
    torch.manual_seed(k)
    w = torch.randn(64, k) * 0.05
    pf, pb = fmt.pack_panels(w), fmt.pack_panels(w.bfloat16())
    x = torch.randn(100, k)
    first = linear.fp32_linear(x, pf, None)
    x.mul_(-2.0)  # same buffer, new values
    assert _rel(linear.fp32_linear(x, pf, None), x @ w.t()) < 1e-5
    assert _rel(linear.bf16_linear(x, pb, None), x @ w.bfloat16().float().t()) < 1e-5
    assert _rel(first, (x / -2.0) @ w.t()) < 1e-5


def _has_amx_bf16() -> bool:
    from kiln.plugins.native import cpu_flags

    return "amx_bf16" in cpu_flags()


def test_bf16_gemm_path_refused_without_amx(native):
    """Where the CPU has no AMX-BF16, torch's brgemm throws on bf16 panels: asking for the route is refused with an
    error that says why, nothing changes, and bf16 panels keep the panel kernels."""
    if _has_amx_bf16():
        pytest.skip("this CPU has AMX-BF16: the oneDNN route is available (test_bf16_panels_onednn_gemm_path)")
    assert linear.bf16_gemm_m() == 0
    with pytest.raises(RuntimeError, match="needs a CPU with AMX-BF16"):
        linear.set_bf16_gemm_m(2)
    assert linear.bf16_gemm_m() == 0 and linear.set_bf16_gemm_m(0) == 0
    assert "oneDNN" not in native_lib.describe_kernel("bf16_panel", 64, 16)
    wb = (torch.randn(16, 64) * 0.05).bfloat16()
    xb = torch.randn(33, 64).bfloat16()
    y = linear.bf16_linear(xb, fmt.pack_panels(wb), None)
    assert _rel(y, (xb.float() @ wb.float().t()).bfloat16()) < 1e-2


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_panels_onednn_gemm_path(native, shape):
    """From bf16_gemm_m rows with bf16 x (prefill on AMX CPUs; forced here from 2 rows, so small shapes take the
    route too), the panels run in place as oneDNN bf16 GEMMs: within bf16
    rounding of the reference, bias included, and within one bf16 rounding of the panel kernels' result; below the
    threshold, and for fp32 x, the panel kernels run as before."""
    if not _has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16: torch's brgemm takes bf16 panels only there (the route is refused)")
    n, k = shape
    torch.manual_seed(n * k + 1)
    w, b = torch.randn(n, k) * 0.05, torch.randn(n)
    wb = w.bfloat16()
    pb = fmt.pack_panels(wb)
    old = linear.set_bf16_gemm_m(2)
    try:
        assert "AMX tiles" in native_lib.describe_kernel("bf16_panel", 2, n)
        assert "AMX" not in native_lib.describe_kernel("bf16_panel", 1, n)
        for m in (2, 5, 16, 33, 64, 65, 200):
            xb = torch.randn(m, k).bfloat16()
            ref = (xb.float() @ wb.float().t() + b).bfloat16()
            for bias in (b, None):
                y = linear.bf16_linear(xb.view(1, m, k), pb, bias)
                want = ref if bias is not None else (xb.float() @ wb.float().t()).bfloat16()
                assert y.shape == (1, m, n) and y.dtype == torch.bfloat16 and _rel(y[0], want) < 1e-2, m
            linear.set_bf16_gemm_m(0)
            kernels = linear.bf16_linear(xb, pb, b)
            linear.set_bf16_gemm_m(2)
            assert _rel(linear.bf16_linear(xb, pb, b), kernels) < 1e-2, m
        x = torch.randn(33, k)  # fp32 x: the panel kernels (fp32 out, no rounding of x)
        assert _rel(linear.bf16_linear(x, pb, b), x @ wb.float().t() + b) < 1e-5
        with pytest.raises(ValueError, match="bf16_gemm_m must be >= 0"):
            linear.set_bf16_gemm_m(-1)
    finally:
        linear.set_bf16_gemm_m(old)


def test_amx_tiles_interleave_with_torchs_brgemm(native):
    """kiln's AMX tile kernel, torch's brgemm (kiln's route at K % 32 != 0) and torch's bf16 flash attention (brgemm
    on AMX) in turn on the same threads: each configures the tiles it runs on, so none computes on another's tile
    shapes (torch caches the config it loaded last per thread; kiln drops that cache before loading its own)."""
    if not _has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16: neither kiln's tile kernel nor torch's bf16 brgemm runs")
    torch.manual_seed(5)
    w, w2 = (torch.randn(96, 1024) * 0.05).bfloat16(), (torch.randn(48, 34) * 0.05).bfloat16()
    x, x2 = torch.randn(200, 1024).bfloat16(), torch.randn(200, 34).bfloat16()
    q = torch.randn(1, 4, 300, 64).bfloat16()
    p, p2 = fmt.pack_panels(w), fmt.pack_panels(w2)
    ref, ref2 = x.float() @ w.float().t(), x2.float() @ w2.float().t()
    ref_attn = F.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
    for _ in range(20):
        assert _rel(linear.bf16_linear(x, p), ref.bfloat16()) < 1e-2
        assert _rel(linear.bf16_linear(x2, p2), ref2.bfloat16()) < 1e-2
        assert (F.scaled_dot_product_attention(q, q, q, is_causal=True).float() - ref_attn).abs().max() < 0.05


def test_bf16_gemm_default_follows_the_cpu(native):
    """On by default (from 5 rows; int8 panels from 24) exactly where the CPU has AMX-BF16; other CPUs keep the
    panel kernels."""
    assert linear.bf16_gemm_m() == (5 if _has_amx_bf16() else 0)
    if _has_amx_bf16():
        assert "AMX tiles" in native_lib.describe_kernel("bf16_panel", 5, 1024)
        assert "AMX" not in native_lib.describe_kernel("bf16_panel", 4, 1024)


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_panels(isa, shape):
    n, k = shape
    torch.manual_seed(n + k)
    q, s = fmt.quantize_int8(torch.randn(n, k))
    b = torch.randn(n)
    p = fmt.pack_panels(q)
    for m in ROWS:
        x = torch.randn(m, k)
        ref = linear.weight_only_linear_reference(x, q, s, b, 8, 0)
        assert _rel(linear.weight_only_linear(x, p, s, b, 8, 0), ref) < 1e-4, m
        assert _rel(linear.weight_only_linear(x.bfloat16(), p, s, b, 8, 0),
                    linear.weight_only_linear_reference(x.bfloat16(), q, s, b, 8, 0)) < 1e-2, m


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_panels_one_row_is_bitwise_a_row_of_many(isa, shape):
    """Decode (one row of x) runs its own kernel (a sequential stream per thread, several accumulator
    chains); its int32 sums are exact, so each row equals, bit for bit, that row of a multi-row call."""
    n, k = shape
    torch.manual_seed(n * k)
    q, s = fmt.quantize_int8(torch.randn(n, k))
    p, x = fmt.pack_panels(q), torch.randn(3, k)
    y = linear.weight_only_linear(x, p, s, None, 8, 0)
    for i in range(3):
        assert torch.equal(linear.weight_only_linear(x[i:i + 1], p, s, None, 8, 0), y[i:i + 1]), i


@pytest.mark.parametrize("rows", [5, 16])  # 16: the one-pass float kernel on AVX-512
def test_int8_panels_propagate_nan_and_inf(isa, rows):
    q, s = fmt.quantize_int8(torch.randn(64, 64))
    x = torch.randn(rows, 64)
    x[1, 3], x[3, 7] = float("nan"), float("inf")
    y = linear.weight_only_linear(x, fmt.pack_panels(q), s, None, 8, 0)
    ref = linear.weight_only_linear_reference(x, q, s, None, 8, 0)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
    ok = torch.isfinite(ref).all(1)
    assert ok.sum() == rows - 2
    assert _rel(y[ok], ref[ok]) < 1e-4


@pytest.mark.parametrize("shape", [(48, 96), (96, 1024), (32, 2816)])
def test_int8_panels_bf16_x_on_amx(native, shape):
    """int8 panels with bf16 x from max(bf16_gemm_m, 24) rows on AMX CPUs: each panel pair converted to bf16 (exact)
    for the tile kernel, the per-output scale and the bias applied as it stores. Within bf16 rounding of the dequantized
    reference and of the int8 kernels, at row counts with tails; NaN/inf in x propagate; fp32 x keeps the kernels."""
    if not _has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16: int8 panels keep the int8 kernels at every M")
    n, k = shape
    torch.manual_seed(n * k + 3)
    q, s = fmt.quantize_int8(torch.randn(n, k))
    b, p = torch.randn(n), fmt.pack_panels(q)
    assert "AMX tiles" in native_lib.describe_kernel("int8_panel", 24, n)
    assert "AMX" not in native_lib.describe_kernel("int8_panel", 23, n)
    for m in (24, 33, 64, 200):
        x = torch.randn(m, k).bfloat16()
        for bias in (b, None):
            ref = linear.weight_only_linear_reference(x, q, s, bias, 8, 0)
            y = linear.weight_only_linear(x, p, s, bias, 8, 0)
            assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1e-2, m
        old = linear.set_bf16_gemm_m(0)
        try:
            kernels = linear.weight_only_linear(x, p, s, b, 8, 0)
        finally:
            linear.set_bf16_gemm_m(old)
        assert _rel(linear.weight_only_linear(x, p, s, b, 8, 0), kernels) < 1e-2, m
    x = torch.randn(33, k).bfloat16()
    x[1, 3], x[3, 7] = float("nan"), float("inf")
    y, ref = linear.weight_only_linear(x, p, s, None, 8, 0), linear.weight_only_linear_reference(x, q, s, None, 8, 0)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))


def test_isa_choice_is_explicit(native):
    best = native_lib.set_panel_isa(0)
    assert best in (256, 512) and native_lib.panel_isa() == best
    assert native_lib.set_panel_isa(256) == 256
    assert native_lib.set_panel_isa(1024) == 256  # not a width: refused, nothing changes
    native_lib.set_panel_isa(0)


def test_a_panel_of_the_other_weight_kind_runs_the_reference(native):
    """A bf16 weight in the fp32 panel shape is not what the bf16 kernels read: the reference runs."""
    w = torch.randn(32, 16).bfloat16()
    odd = w.reshape(2, 16, 16).permute(0, 2, 1).contiguous()  # [out/16, in, 16]
    x = torch.randn(3, 16)
    torch.testing.assert_close(linear.bf16_linear(x, odd), x @ w.float().t(), atol=1e-5, rtol=1e-5)


def test_avx512_instructions_only_in_the_kernels_cpuid_chooses(native):
    """The library must run on AVX2-only CPUs (the wheel's prebuilt one included): every EVEX-encoded
    (AVX-512) instruction sits in a k512:: function, compiled under its own ``#pragma GCC target`` and
    entered only when CPUID reports AVX-512 (best_panel_isa); nothing else was compiled for AVX-512."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    out = subprocess.run([objdump, "-d", "-C", "--insn-width=16", native_lib.library()._name],
                         capture_output=True, text=True, check=True).stdout
    func, evex = None, set()
    for line in out.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if head:
            func = head.group(1)
            continue
        cols = line.split("\t")
        if len(cols) >= 3 and re.match(r"\s*(67 )?62 ", cols[1]):   # 0x62 opens an EVEX prefix in 64-bit code
            evex.add(func)
    assert any("k512::" in f for f in evex), "no AVX-512 kernel found: the check would see nothing"
    assert all("k512::" in f for f in evex), sorted(f for f in evex if "k512::" not in f)[:10]


def test_env_var_forces_the_avx2_kernels():
    """KILN_PANEL_ISA=256 (how CI on an AVX-512 machine covers the AVX2 path end to end)."""
    code = "from kiln.plugins import native; print(native.panel_isa())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KILN_PANEL_ISA": "256"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == "256"


# ---- int4 panels ---------------------------------------------------------------------------------------------
INT4_SHAPES = [(16, 64, 32), (48, 256, 64), (96, 1024, 128), (32, 2816, 32), (64, 512, 512)]   # (out, in, group)


def _int4(n, k, gs, zeros: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = fmt.quantize_int4_panels(torch.randn(n, k, generator=g), gs)
    if zeros:   # GPTQ / AWQ-style zero points
        u, s, _ = fmt.unpack_int4_panels(p)
        p = fmt.pack_int4_panels(u, s, torch.randint(0, 16, (n, k // gs), generator=g).to(torch.uint8), gs)
    return p


@pytest.fixture
def int4_kernels_only(native):
    """The int4 kernels at every M (no bf16 GEMM path, which AMX CPUs take from int4_gemm_m rows)."""
    old = linear.set_int4_gemm_m(0)
    yield
    linear.set_int4_gemm_m(old)


@pytest.mark.parametrize("shape", INT4_SHAPES)
@pytest.mark.parametrize("zeros", [False, True])
def test_int4_panels(isa, shape, zeros, int4_kernels_only):
    n, k, gs = shape
    p = _int4(n, k, gs, zeros, n + k)
    b = torch.randn(n)
    for m in ROWS:
        x = torch.randn(m, k)
        ref = linear.weight_only_linear_reference(x, p.qweight, p.scales, b, 4, gs, p.zeros)
        assert _rel(linear.weight_only_linear(x, p.qweight, p.scales, b, 4, gs, p.zeros), ref) < 1e-4, m
        xb = x.bfloat16()
        y = linear.weight_only_linear(xb, p.qweight, p.scales, b, 4, gs, p.zeros)
        ref = linear.weight_only_linear_reference(xb, p.qweight, p.scales, b, 4, gs, p.zeros)
        assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1e-2, m


@pytest.mark.parametrize("shape", INT4_SHAPES)
def test_int4_panels_bf16_gemm_path(native, shape):
    """From int4_gemm_m rows (the prefill path on AMX CPUs; forced here from 1 row, on any CPU) the weight is
    dequantized to bf16, bit for bit the reference's fp32 weight rounded to bf16, and x rounded to bf16 for a
    bf16 GEMM: within bf16 rounding of the reference, bias and zero points included."""
    import ctypes

    n, k, gs = shape
    p = _int4(n, k, gs, True, n * 3 + k)
    wb = torch.empty(n, k, dtype=torch.bfloat16)
    lib = native_lib.library()
    assert lib.kiln_dequant_int4_panel_bf16(p.qweight.data_ptr(), p.scales.data_ptr(), p.zeros.data_ptr(), gs, n, k,
                                            wb.data_ptr(), 2) == 0
    assert torch.equal(wb, fmt.dequantize_int4_panels(p).bfloat16())
    assert lib.kiln_dequant_int4_panel_bf16(p.qweight.data_ptr(), p.scales.data_ptr(), None, 12, n, k,
                                            ctypes.c_void_p(wb.data_ptr()), 2) == 2   # group 12: not the layout
    g = torch.Generator().manual_seed(n + k)
    b = torch.randn(n, generator=g)
    w_abs = fmt.dequantize_int4_panels(p).abs().double()
    old = linear.set_int4_gemm_m(1)
    try:
        assert "oneDNN bf16 GEMM" in native_lib.describe_kernel("int4_panel", 1, n)
        for m in (1, 5, 33):
            x = torch.randn(m, k, generator=g)
            for xx in (x, x.bfloat16()):
                y = linear.weight_only_linear(xx, p.qweight, p.scales, b, 4, gs, p.zeros)
                ref = linear.weight_only_linear_reference(xx, p.qweight, p.scales, b, 4, gs, p.zeros).double()
                # bf16 rounding of the weight and of x (2^-9 relative each) bounds every product's error by 2^-8,
                # and a bf16 output rounds once more (2^-9 of it)
                bound = 2.0**-8 * (xx.double().abs() @ w_abs.t()) + 2.0**-8 * ref.abs() + 1e-4
                assert y.dtype == xx.dtype and ((y.double() - ref).abs() <= bound).all(), (m, xx.dtype)
        with pytest.raises(ValueError, match="int4_gemm_m must be >= 0"):
            linear.set_int4_gemm_m(-1)
    finally:
        linear.set_int4_gemm_m(old)


def test_int4_panel_layout_and_round_trip():
    g = torch.Generator().manual_seed(3)
    u = torch.randint(0, 16, (48, 64), generator=g).to(torch.uint8)
    s = torch.rand(48, 2, generator=g).half()
    z = torch.randint(0, 16, (48, 2), generator=g).to(torch.uint8)
    p = fmt.pack_int4_panels(u, s, z, 32)
    assert p.qweight.shape == (3, 8, 64) and p.scales.shape == p.zeros.shape == (3, 2, 16)
    for n, k in ((37, 21), (0, 0), (47, 63), (16, 8)):   # element (n, k): word n%16*2 + k%2 of its block, nibble k%8//2
        block = p.qweight[n // 16, k // 8]
        i = (n % 16) * 2 + k % 2
        word = int(block[2 * i]) | int(block[2 * i + 1]) << 8
        assert (word >> 4 * (k % 8 // 2)) & 15 == u[n, k]
    assert [torch.equal(a, b) for a, b in zip(fmt.unpack_int4_panels(p), (u, s, z))] == [True] * 3
    w = fmt.dequantize_int4_panels(p)
    assert torch.equal(w[5, 40:48], (u[5, 40:48].float() - float(z[5, 1])) * float(s[5, 1]))
    with pytest.raises(ValueError, match="group_size"):
        fmt.pack_int4_panels(u, s, z, 12)
    with pytest.raises(ValueError, match="float16 scales"):
        linear.weight_only_linear(torch.randn(2, 64), p.qweight, s.float(), None, 4, 32, p.zeros)


@pytest.fixture(params=[16, 8])
def x_bits(request, native):
    """Both roundings of x in the int4-panel kernels: int16 per row (the default) and int8 per group."""
    old = linear.set_int4_x_bits(request.param)
    yield request.param
    linear.set_int4_x_bits(old)


def _x8_reference(x, p, bias, gs):
    """y as the x8 kernels compute it, in float64: x rounded as theirs (int8 per group of gs, scale max|x| / 127
    in fp32, round half to even) times the dequantized weight; and each output's bound on its distance from the
    unrounded product, sum over groups of scale / 2 * sum |w|."""
    w = fmt.dequantize_int4_panels(p).double()
    xg = x.float().reshape(x.shape[0], -1, gs)
    s = xg.abs().amax(-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(torch.clamp(xg * (1.0 / s), -127, 127))
    xr = (q.double() * s.double()).reshape(x.shape)
    err = (s.double().squeeze(-1) / 2) @ w.abs().reshape(w.shape[0], -1, gs).sum(-1).t()
    y = xr @ w.t() + (bias.double() if bias is not None else 0)
    return y, err


@pytest.mark.parametrize("shape", INT4_SHAPES)
@pytest.mark.parametrize("zeros", [False, True])
def test_int4_x8_panels_are_the_int8_rounding_of_x(isa, shape, zeros, int4_kernels_only):
    """x8: the kernel's output is x rounded to int8 per group times the weight (to fp32 summation order), and
    within that rounding's bound of the reference (the exact product)."""
    n, k, gs = shape
    p = _int4(n, k, gs, zeros, n + k)
    b = torch.randn(n)
    old = linear.set_int4_x_bits(8)
    try:
        assert "x int8 per group" in native_lib.describe_kernel("int4_panel", 1, n)
        for m in (1, 2, 5, 16, 33, 200):
            x = torch.randn(m, k) * torch.linspace(0.1, 3, k)   # groups of different ranges
            y = linear.weight_only_linear(x, p.qweight, p.scales, b, 4, gs, p.zeros)
            want, err = _x8_reference(x, p, b, gs)
            assert _rel(y, want) < 2e-6, m
            ref = linear.weight_only_linear_reference(x, p.qweight, p.scales, b, 4, gs, p.zeros).double()
            assert ((y.double() - ref).abs() <= err * 1.001 + 1e-5 * ref.abs().max()).all(), m
            assert _rel(y, ref) > 1e-6, m   # the rounding is there (the int16 path is ~1e-5 of it)
            xb = x.bfloat16()
            yb = linear.weight_only_linear(xb, p.qweight, p.scales, b, 4, gs, p.zeros)
            assert yb.dtype == torch.bfloat16 and _rel(yb, _x8_reference(xb.float(), p, b, gs)[0]) < 1e-2, m
    finally:
        linear.set_int4_x_bits(old)


def test_int4_x_bits_setting(native):
    with pytest.raises(ValueError, match="8 or 16"):
        linear.set_int4_x_bits(4)
    assert linear.int4_x_bits() == 16   # the default
    env = dict(os.environ, KILN_INT4_X_BITS="8")
    out = subprocess.run([sys.executable, "-c", "from kiln.plugins import linear; print(linear.int4_x_bits())"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-1] == "8", out.stderr[-2000:]


@pytest.mark.parametrize("shape", INT4_SHAPES[:3])
def test_int4_panels_one_row_is_bitwise_a_row_of_many(isa, shape, x_bits):
    n, k, gs = shape
    p = _int4(n, k, gs, True, n)
    x = torch.randn(5, k)
    y = linear.weight_only_linear(x, p.qweight, p.scales, None, 4, gs, p.zeros)
    for i in range(5):
        assert torch.equal(linear.weight_only_linear(x[i:i + 1], p.qweight, p.scales, None, 4, gs, p.zeros),
                           y[i:i + 1]), i


def test_int4_panels_propagate_nan_and_inf(isa, x_bits):
    p = _int4(32, 64, 32, False, 1)
    x = torch.randn(4, 64)
    x[1, 3], x[2, 7] = float("nan"), float("inf")
    y = linear.weight_only_linear(x, p.qweight, p.scales, None, 4, 32)
    ref = linear.weight_only_linear_reference(x, p.qweight, p.scales, None, 4, 32)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))


@pytest.mark.parametrize("seed", range(8))
def test_int4_panels_quantization_error_bound(seed):
    """Rounded values are within half a scale; the one clamped case (an element of the other sign than the
    largest, near its magnitude, maps past +7) is off by |max| - 7|scale|, which the float16 rounding of the
    scale can take a little past one scale (CI hit 1.0001)."""
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(seed))
    w[0, :64] = torch.linspace(-1, 1, 64)   # a group whose +max sits at -max: the clamp at 7 is hit
    p = fmt.quantize_int4_panels(w, 64)
    err = (fmt.dequantize_int4_panels(p) - w).abs().reshape(32, 4, 64).amax(-1)
    scale = p.scales.float().abs().transpose(1, 2).reshape(32, 4)
    largest = w.abs().reshape(32, 4, 64).amax(-1)
    bound = torch.maximum(0.5 * scale, largest - 7 * scale)
    assert (err <= bound * 1.0001 + 1e-7).all()
    assert (err <= scale * 1.004).all()   # float16's rounding: |max| <= 8 |scale| (1 + 2^-11)
    assert err[0, 0] >= 0.99 * scale[0, 0]


# ---- tuning --------------------------------------------------------------------------------------------------
def test_tunables_set_get_and_describe(native):
    from kiln.plugins import tuning

    lib = native_lib.library()
    old = tuning.current(lib)
    assert set(old) == set(tuning.TUNABLES) and all(v >= 0 for v in old.values())
    try:
        tuning.set_value(lib, "row_prefetch", 3072)
        assert native_lib.kernel_tuning()["row_prefetch"] == 3072
        tuning.set_value(lib, "int8_row_panels", 1)
        tuning.set_value(lib, "row_panels", 1)   # the machine's tuned choice may be 2 or 4: pin both branches
        assert "one-row stream" in native_lib.describe_kernel("int4_panel", 1, 1024)
        tuning.set_value(lib, "row_panels", 4)
        assert "one row x 4 panels, prefetch 3072 B" in native_lib.describe_kernel("int4_panel", 1, 1024)
        assert "one-row stream, 4 chains, prefetch 3072 B" in native_lib.describe_kernel("int8_panel", 1, 1024)
        tuning.set_value(lib, "int8_row_panels", 4)
        tuning.set_value(lib, "int8_row_prefetch", 1536)
        assert "one row x 4 panels, prefetch 1536 B" in native_lib.describe_kernel("int8_panel", 1, 1024)
        width = "avx512" if native_lib.panel_isa() == 512 else "avx2"
        assert native_lib.describe_kernel("fp32_panel", 48, 1024).startswith(f"fp32 panels, {width}")
        split_from = linear.fp32_gemm_m()   # prefill rows on AMX CPUs: the split-bf16 tiles
        assert ("bf16 halves" in native_lib.describe_kernel("fp32_panel", 200, 1024)) == (0 < split_from <= 200)
        if width == "avx512":
            tuning.set_value(lib, "onepass_split", 1)
            assert "rows 0-11 then 12-15 over panel pairs" in native_lib.describe_kernel("fp32_panel", 16, 1024)
            assert "one pass of 16 rows" in native_lib.describe_kernel("fp32_panel", 16, 1040)   # 65 panels
            tuning.set_value(lib, "onepass_split", 0)
            assert "one pass of 16 rows" in native_lib.describe_kernel("fp32_panel", 16, 1024)
        with pytest.raises(ValueError, match="out of range"):
            tuning.set_value(lib, "onepass_split", 2)
        with pytest.raises(ValueError, match="unknown kernel tunable 'nope'"):
            tuning.set_value(lib, "nope", 1)
        with pytest.raises(ValueError, match="out of range"):
            tuning.set_value(lib, "row_prefetch", -1)
    finally:
        for name, value in old.items():
            tuning.set_value(lib, name, value)


def test_tuning_is_measured_once_cached_and_overridable(native, tmp_path, monkeypatch):
    """A fresh cache: apply() measures and writes it; the next apply() reads it; KILN_TUNING overrides."""
    from kiln.plugins import tuning

    lib = native_lib.library()
    old = tuning.current(lib)
    monkeypatch.setenv("KILN_TUNING_DIR", str(tmp_path))
    monkeypatch.delenv("KILN_AUTOTUNE", raising=False)
    monkeypatch.delenv("KILN_TUNING", raising=False)
    measure = tuning.autotune   # a loaded test machine may need more than the load-time budget
    monkeypatch.setattr(tuning, "autotune", lambda lib, n: measure(lib, n, budget_s=600, max_other_load=64))
    try:
        measured = tuning.apply(lib, "ktest")
        path = tuning.cache_path("ktest")
        assert path.is_file() and tuning.cpu_signature() in path.name
        cached = json.loads(path.read_text())["tuning"]
        assert cached == {k: measured[k] for k in cached}
        # a non-temporal one-row stream (row_nta, the default) takes a non-zero distance
        assert cached["row_prefetch"] in (tuning.NTA_CANDIDATES if measured["row_nta"] else tuning.CANDIDATES)
        # cached and in range (measured where the library runs AVX-512; elsewhere the defaults, never run there)
        assert cached["onepass_split"] in (0, 1) and cached["onepass_prefetch"] >= 0
        path.write_text(json.dumps({"tuning": {**cached, "row_prefetch": 1536}}))   # read, not re-measured
        assert tuning.apply(lib, "ktest")["row_prefetch"] == 1536
        monkeypatch.setenv("KILN_TUNING", "small_prefetch=640")
        assert tuning.apply(lib, "ktest")["small_prefetch"] == 640
        monkeypatch.setenv("KILN_TUNING", "bogus=1")
        with pytest.raises(ValueError, match="KILN_TUNING='bogus=1'"):
            tuning.apply(lib, "ktest")
    finally:
        for name, value in old.items():
            tuning.set_value(lib, name, value)


def test_autotune_choices():
    """Every tunable's default (from whole decodes) stands unless the kernel alone is slower with it by more than TIE
    (Sapphire Rapids: 1.3x slower non-temporal); then distances take the shortest within TIE of the fastest, row_nta
    and the panel counts the fastest."""
    from kiln.plugins import tuning

    assert tuning.choose("row_prefetch", {0: 2.1, 512: 2.05, 2048: 2.0}, 2048) == 2048   # alike alone: the default
    assert tuning.choose("row_prefetch", {0: 2.1, 512: 2.05, 2048: 2.0}, 512) == 512
    assert tuning.choose("row_prefetch", {0: 3.2, 512: 2.1, 2048: 2.5}, 2048) == 512     # clearly slower: replaced
    assert tuning.choose("row_prefetch", {0: 3.2, 512: 2.5, 2048: 2.0}, 0) == 2048
    assert tuning.choose("row_nta", {1: 2.1, 0: 2.0}, 1) == 1      # alike alone: the default (Zen 4)
    assert tuning.choose("row_nta", {1: 3.38, 0: 2.63}, 1) == 0    # slower alone: off (Sapphire Rapids)
    assert tuning.choose("row_nta", {0: 2.1, 1: 2.0}, 0) == 0
    assert tuning.choose("row_panels", {4: 2.11, 1: 2.05, 2: 2.33}, 4) == 4   # Sapphire Rapids' default
    assert tuning.choose("row_panels", {1: 2.6, 2: 2.3, 4: 2.1}, 1) == 4


def test_autotuning_leaves_the_loading_thread_without_an_openmp_team(native, tmp_path):
    """The first load of a library build measures its tunables with OpenMP kernels; run on the loading thread they
    would leave it a thread team for the life of the process, and two teams on the machine's cores make every
    parallel region of the step loop sleep and wake (that process decoded at 40% of the next one's speed). The
    measuring thread's team must go with it: as many threads after the first load as before."""
    code = ("import os, time, torch; threads = lambda: len(os.listdir('/proc/self/task')); before = threads(); "
            "from kiln.plugins import native; assert native.library() is not None; deadline = time.monotonic() + 10\n"
            "while threads() > before and time.monotonic() < deadline: time.sleep(0.05)\n"   # workers exit just after
            "print(before, threads(), len(os.listdir(os.environ['KILN_TUNING_DIR'])))")
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_AUTOTUNE", "KILN_TUNING")}
    env["KILN_TUNING_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, cached = map(int, out.stdout.split()[-3:])
    assert after == before, f"{after - before} thread(s) left behind by the load-time autotune"
    assert cached in (0, 1)   # 0: a machine too busy to measure in the budget (nothing cached, defaults kept)


def test_autotuning_beside_a_busy_process_keeps_the_defaults(native):
    """A tuning measured while another process computes (a compiler still running from an engine build) is noise:
    the autotune gives up and leaves the tunables as they were (nothing cached: measured at a later load)."""
    from kiln.plugins import tuning

    cores = os.cpu_count() or 1
    if cores > 16:
        pytest.skip("keeping a machine of more than 16 cores busy is not this test's job")
    lib = native_lib.library()
    old = tuning.current(lib)
    # every core the 2-thread measurement leaves free, and one more
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(1, cores - 1))]
    try:
        time.sleep(0.3)
        with pytest.raises(tuning.TuningAborted, match="cores busy during the kernel autotuning"):
            tuning.autotune(lib, 2, budget_s=600)
    finally:
        for spin in spinners:
            spin.kill()
            spin.wait()
    assert tuning.current(lib) == old


def test_autotuning_past_its_budget_keeps_the_defaults(native):
    from kiln.plugins import tuning

    lib = native_lib.library()
    old = tuning.current(lib)
    with pytest.raises(tuning.TuningAborted, match="busy machine"):
        tuning.autotune(lib, 2, budget_s=0)
    assert tuning.current(lib) == old


@pytest.mark.parametrize("n", [256, 192, 80])
@pytest.mark.parametrize("row_panels", [2, 4, 8])
def test_int4_decode_over_several_panels_is_bitwise_the_one_stream_kernel(isa, row_panels, n, x_bits):
    """row_panels (a tunable) changes how many panels a decode thread reads at once, not the sums; where it does not
    divide the panels (192 = 12 panels, 80 = 5) the decode reads 4 where that divides them, else one stream."""
    from kiln.plugins import tuning

    lib = native_lib.library()
    p = _int4(n, 1024, 64, True, 5)
    x = torch.randn(1, 1024)
    old = tuning.get(lib, "row_panels")
    try:
        tuning.set_value(lib, "row_panels", 1)
        one = linear.weight_only_linear(x, p.qweight, p.scales, None, 4, 64, p.zeros)
        tuning.set_value(lib, "row_panels", row_panels)
        panels = n // 16
        runs = row_panels if panels % row_panels == 0 else 4 if row_panels > 4 and panels % 4 == 0 else 1
        what = native_lib.describe_kernel("int4_panel", 1, n)
        assert (f"one row x {runs} panels" if runs > 1 else "one-row stream") in what, what
        assert torch.equal(linear.weight_only_linear(x, p.qweight, p.scales, None, 4, 64, p.zeros), one)
        with pytest.raises(ValueError, match="row_panels 1, 2, 4 or 8"):
            tuning.set_value(lib, "row_panels", 3)
    finally:
        tuning.set_value(lib, "row_panels", old)


@pytest.fixture
def tunables(native):
    """The native library; every kernel tunable the test sets is put back after it."""
    from kiln.plugins import tuning

    lib = native_lib.library()
    old = tuning.current(lib)
    yield lib
    for name, value in old.items():
        tuning.set_value(lib, name, value)


def _one_row_decodes(seed: int, int4_panels: tuple[int, ...] = (1,)):
    """outputs() of one-row int8 and int4 decodes of fixed random weights and x: the int8 one, then the int4 one at
    each row_panels of ``int4_panels`` (the thread layouts the one-row tunables act on)."""
    from kiln.plugins import tuning

    lib = native_lib.library()
    g = torch.Generator().manual_seed(seed)
    p = _int4(128, 1024, 64, True, seed - 7)
    q, s = fmt.quantize_int8(torch.randn(192, 1000, generator=g))
    qp = fmt.pack_panels(q)
    x4, x8 = torch.randn(1, 1024, generator=g), torch.randn(1, 1000, generator=g)

    def outputs() -> list[torch.Tensor]:
        out = [linear.weight_only_linear(x8, qp, s, None, 8, 0)]
        for panels in int4_panels:
            tuning.set_value(lib, "row_panels", panels)
            out.append(linear.weight_only_linear(x4, p.qweight, p.scales, None, 4, 64, p.zeros))
        return out

    return outputs


def test_non_temporal_decode_streams_change_no_result(isa, x_bits, tunables):
    """row_nta (a tunable) only changes the cache hint of the one-row decode streams' prefetches: int4 (one stream
    and several panels a thread) and int8 give the same bits either way, and kiln inspect --load says which."""
    from kiln.plugins import tuning

    outputs = _one_row_decodes(13, int4_panels=(1, 4))
    tuning.set_value(tunables, "row_prefetch", 512)
    tuning.set_value(tunables, "row_nta", 0)
    plain = outputs()
    assert "non-temporal" not in native_lib.describe_kernel("int8_panel", 1, 192)
    tuning.set_value(tunables, "row_nta", 1)
    assert all(torch.equal(a, b) for a, b in zip(outputs(), plain))
    assert "prefetch 512 B non-temporal" in native_lib.describe_kernel("int4_panel", 1, 128)
    assert "non-temporal" not in native_lib.describe_kernel("int4_panel", 16, 128)   # batches reuse a tile
    with pytest.raises(ValueError, match="row_nta 0 or 1"):
        tuning.set_value(tunables, "row_nta", 2)


def test_decode_start_burst_changes_no_result(isa, x_bits, tunables):
    """row_burst (a tunable) only asks for the first bytes of each thread's run at once: int4 and int8 one-row
    decodes give the same bits with and without it, at a burst past a thread's whole run too."""
    from kiln.plugins import tuning

    outputs = _one_row_decodes(14)
    tuning.set_value(tunables, "int8_row_panels", 1)
    tuning.set_value(tunables, "row_burst", 0)
    plain = outputs()
    assert "at the start" not in native_lib.describe_kernel("int4_panel", 1, 128)
    for burst in (4096, 1 << 16):
        tuning.set_value(tunables, "row_burst", burst)
        assert all(torch.equal(a, b) for a, b in zip(outputs(), plain)), burst
        assert f"{burst} B at the start" in native_lib.describe_kernel("int8_panel", 1, 192)


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_bf16_decode_prefetch_and_panels_change_no_result(isa, xdtype, tunables):
    """bf16_row_prefetch and bf16_row_panels (tunables) only ask for cache lines early and change how many panels a
    decode tile reads at once: both decode paths of bf16 panels (fp32 x: the float path, always 4 panels a tile;
    bf16 x: the bf16 dot product where the CPU has it) give the same bits at any distance and panel count."""
    from kiln.plugins import tuning

    g = torch.Generator().manual_seed(12)
    w = fmt.pack_panels((torch.randn(256, 1024, generator=g) * 0.02).bfloat16())
    x = torch.randn(3, 1024, generator=g).to(xdtype)
    dot_cpu = isa == 512 and "avx512_bf16" in native_lib.cpu_info().get("flags", "").split()   # what describe says
    tuning.set_value(tunables, "bf16_row_prefetch", 0)
    tuning.set_value(tunables, "bf16_row_panels", 4)
    plain = [linear.bf16_linear(x[:m], w) for m in (1, 2, 3)]
    assert "prefetch" not in native_lib.describe_kernel("bf16_panel", 1, 256)
    for panels in (2, 4, 8, 16):
        tuning.set_value(tunables, "bf16_row_panels", panels)
        for dist in (0, 512, 4096):
            tuning.set_value(tunables, "bf16_row_prefetch", dist)
            tiles = ("1x16" if panels == 16 else f"2x{panels}") + " tiles" if dot_cpu else "2x4 tiles"
            assert tiles + (f", prefetch {dist} B" if dist else "") in native_lib.describe_kernel("bf16_panel", 1, 256)
            got = [linear.bf16_linear(x[:m], w) for m in (1, 2, 3)]
            assert all(torch.equal(a, b) for a, b in zip(got, plain)), (panels, dist)
    # 12 panels (N = 192) do not divide into 8: the 4-panel tiles, not the batched tiles
    tuning.set_value(tunables, "bf16_row_panels", 8)
    assert "2x4 tiles" in native_lib.describe_kernel("bf16_panel", 1, 192)
    w12 = fmt.pack_panels((torch.randn(192, 1024, generator=g) * 0.02).bfloat16())
    tuning.set_value(tunables, "bf16_row_panels", 4)
    four = linear.bf16_linear(x[:1], w12)
    tuning.set_value(tunables, "bf16_row_panels", 8)
    assert torch.equal(linear.bf16_linear(x[:1], w12), four)
    with pytest.raises(ValueError, match="bf16_row_panels 2, 4, 8 or 16"):
        tuning.set_value(tunables, "bf16_row_panels", 3)


@pytest.mark.parametrize("int8_row_panels", [2, 4, 8])
def test_int8_decode_over_several_panels_is_bitwise_the_one_stream_kernel(isa, int8_row_panels):
    """int8_row_panels (a tunable) changes how many panels a decode thread reads at once, not the sums."""
    from kiln.plugins import tuning

    lib = native_lib.library()
    g = torch.Generator().manual_seed(11)
    q, s = fmt.quantize_int8(torch.randn(256, 1000, generator=g))
    qp = fmt.pack_panels(q)
    x = torch.randn(1, 1000, generator=g)
    old = tuning.current(lib)
    try:
        tuning.set_value(lib, "int8_row_panels", 1)
        one = linear.weight_only_linear(x, qp, s, None, 8, 0)
        ref = linear.weight_only_linear_reference(x, q, s, None, 8, 0)
        torch.testing.assert_close(one, ref, atol=ref.abs().max().item() * 1e-4, rtol=1e-4)
        tuning.set_value(lib, "int8_row_panels", int8_row_panels)
        assert f"one row x {int8_row_panels} panels" in native_lib.describe_kernel("int8_panel", 1, 256)
        for dist in (0, 2048):   # the prefetch distance of those streams (a tunable) changes no sum either
            tuning.set_value(lib, "int8_row_prefetch", dist)
            assert torch.equal(linear.weight_only_linear(x, qp, s, None, 8, 0), one)
        with pytest.raises(ValueError, match="int8_row_panels the same"):
            tuning.set_value(lib, "int8_row_panels", 3)
    finally:
        for name, value in old.items():
            tuning.set_value(lib, name, value)


def _split_bound(x, w):
    """What the split-bf16 route may differ from the exact product by: each operand kept to ~16 significant bits
    (hi and lo halves, each rounded to nearest: <= 2^-18 of it left out), the lo x lo product dropped (<= 2^-18)
    and fp32 sums; 2^-14 of |x| |w|^T leaves room for the sums and is 32x below what one missing lo product
    (2^-9) would cost."""
    return 2.0 ** -14 * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize("shape", [(64, 64), (48, 96), (96, 1024), (32, 2816), (1040, 64)])
def test_fp32_panels_split_bf16_amx_path(native, shape):
    """From fp32_gemm_m rows (forced here from 2), fp32 panels with fp32 x run on AMX tiles with both operands split
    into bf16 halves: within the split's bound of the float64 product at every row count (tails of 32-row blocks,
    one sweep and several with the split panels kept, an odd panel count), bias or none, x's leading dims kept;
    below the threshold the fp32 kernels' result bit for bit."""
    if not _has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16: fp32 panels keep the fp32 kernels (test_fp32_split_refused_without_amx)")
    n, k = shape
    torch.manual_seed(n + k)
    w, b = torch.randn(n, k) * 0.05, torch.randn(n)
    pf = fmt.pack_panels(w)
    old = linear.set_fp32_gemm_m(2)
    try:
        assert "bf16 halves" in native_lib.describe_kernel("fp32_panel", 2, n)
        assert "bf16 halves" not in native_lib.describe_kernel("fp32_panel", 1, n)
        for m in (2, 31, 32, 33, 64, 128, 129, 300):
            x = torch.randn(m, k)
            exact = x.double() @ w.double().t()
            for bias in (b, None):
                y = linear.fp32_linear(x.view(1, m, k), pf, bias)
                want = exact + (b.double() if bias is not None else 0)
                assert y.shape == (1, m, n) and y.dtype == torch.float32
                assert ((y[0].double() - want).abs() <= _split_bound(x, w)).all(), (m, bias is None)
            # the route really ran: the result is not the fp32 kernels' (exact fp32 products round differently)
            linear.set_fp32_gemm_m(0)
            kernels = linear.fp32_linear(x, pf, b)
            linear.set_fp32_gemm_m(2)
            assert not torch.equal(linear.fp32_linear(x, pf, b), kernels), m
        x = torch.randn(1, k)   # below the threshold: the fp32 kernels
        linear.set_fp32_gemm_m(0)
        kernels = linear.fp32_linear(x, pf, b)
        linear.set_fp32_gemm_m(2)
        assert torch.equal(linear.fp32_linear(x, pf, b), kernels)
        with pytest.raises(ValueError, match="fp32_gemm_m must be >= 0"):
            linear.set_fp32_gemm_m(-1)
    finally:
        linear.set_fp32_gemm_m(old)


def test_fp32_split_path_carries_inf_and_nan_as_the_kernels_do(native):
    """inf or NaN in x cannot be split into halves (the remainder is NaN): such a call runs the fp32 kernels, so
    the outputs are theirs, non-finite where the reference's are; a finite value near the fp32 maximum whose bf16
    rounding overflows takes the same way."""
    if not _has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16: no split route")
    torch.manual_seed(3)
    w = torch.randn(32, 64) * 0.05
    pf = fmt.pack_panels(w)
    old = linear.set_fp32_gemm_m(2)
    try:
        for bad in (float("inf"), float("-inf"), float("nan"), 3.4028234e38):
            x = torch.randn(200, 64)
            x[150, 7] = bad
            y = linear.fp32_linear(x, pf, None)
            linear.set_fp32_gemm_m(0)
            kernels = linear.fp32_linear(x, pf, None)
            linear.set_fp32_gemm_m(2)
            torch.testing.assert_close(y, kernels, rtol=0, atol=0, equal_nan=True)
            assert y[150].isfinite().all() == (abs(bad) < float("inf")), bad
    finally:
        linear.set_fp32_gemm_m(old)


def test_fp32_split_is_chosen_only_on_request(native):
    """Off by default (fp32 engines keep exact fp32 products); KILN_FP32_MATMUL=high at start turns it on from 64 rows
    where the CPU has AMX-BF16, and a CPU without it refuses the setter with the reason."""
    assert linear.fp32_gemm_m() == 0
    code = "from kiln.plugins import linear; print(linear.fp32_gemm_m())"
    for value, want in (("high", "64" if _has_amx_bf16() else "0"), ("highest", "0")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "KILN_FP32_MATMUL": value})
        assert out.stdout.strip().splitlines()[-1] == want, (value, out.stdout, out.stderr)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "KILN_FP32_MATMUL": "hihg"})
    assert out.stdout.strip().splitlines()[-1] == "0" and "KILN_FP32_MATMUL='hihg' is not one of" in out.stderr
    if not _has_amx_bf16():
        with pytest.raises(RuntimeError, match="needs a CPU with AMX-BF16"):
            linear.set_fp32_gemm_m(64)
        assert linear.fp32_gemm_m() == 0


@pytest.mark.parametrize("shape", [(64, 64), (48, 96), (96, 1024), (32, 2816)])
def test_int8_panels_with_fp32_x_take_the_tiles_with_x_split(native, shape):
    """From int8_split_m rows (64 on AMX CPUs) fp32 x over int8 panels runs on AMX tiles, x split into bf16 halves
    (the int8 weights are exact in bf16): within 2^-14 of |x| |w|^T of the exact product at every row count (block
    tails, several sweeps, an odd panel count), closer to it than the int8 kernels (x rounded to int16 per row);
    bf16_gemm_m = 0 turns it off with the other AMX routes; inf or NaN in x runs the int8 kernels."""
    if not _has_amx_bf16():
        pytest.skip("this CPU has no AMX-BF16: int8 panels keep the int8 kernels")
    n, k = shape
    torch.manual_seed(n * k + 7)
    w, b = torch.randn(n, k) * 0.05, torch.randn(n)
    q, s = fmt.quantize_int8(w)
    qp, wq = fmt.pack_panels(q), q.double() * s.double()[:, None]
    assert "x split into bf16 halves" in native_lib.describe_kernel("int8_panel", 64, n)
    assert "x split" not in native_lib.describe_kernel("int8_panel", 63, n)
    for m in (64, 65, 128, 129, 300):
        x = torch.randn(m, k)
        exact = x.double() @ wq.t() + b.double()
        bound = 2.0 ** -14 * (x.double().abs() @ wq.abs().t())
        y = linear.weight_only_linear(x.view(1, m, k), qp, s, b, bits=8)
        assert y.shape == (1, m, n) and y.dtype == torch.float32
        split_err = (y[0].double() - exact).abs()
        assert (split_err <= bound).all(), m
        old = linear.set_bf16_gemm_m(0)
        try:
            kernels = linear.weight_only_linear(x, qp, s, b, bits=8)
        finally:
            linear.set_bf16_gemm_m(old)
        assert split_err.mean() < (kernels.double() - exact).abs().mean(), m
    x = torch.randn(100, k)
    x[40, 3] = float("nan")
    y = linear.weight_only_linear(x, qp, s, b, bits=8)
    assert y[40].isnan().all() and y[torch.arange(100) != 40].isfinite().all()
