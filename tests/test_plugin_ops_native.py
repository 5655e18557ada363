"""The C++ CPU kernels of the norm / rotary / activation / paged attention ops (plugins/csrc/plugin_ops.cpp)
against the plain-torch references, and the torch fallback path (native kernels disabled)."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_plugins import NEAR, TOL, assert_same_pool, build_case, run_both

import kiln.plugins  # noqa: F401
from kiln.plugins.activations import gelu_reference, silu_mul_reference
from kiln.plugins.native import native_kernels_disabled, native_op_ready
from kiln.plugins.rms_norm import rms_norm_reference
from kiln.plugins.rotary import cos_sin_table, rope_inv_freq, rotary_embedding_reference

ops = torch.ops.kiln
pa = importlib.import_module("kiln.plugins.paged_attention")
OPS = ["rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_mul", "gelu", "paged_attention", "argmax_rows"]
EXACT = dict(rtol=0, atol=0)
CLOSE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.fixture(params=["native", "torch"])
def mode(request):
    if request.param == "native":
        if not all(native_op_ready(op) for op in OPS):
            pytest.skip("native kernels unavailable")
        yield "native"
    else:
        with native_kernels_disabled():
            yield "torch"


def test_native_kernels_registered():
    if not native_op_ready("rms_norm"):
        pytest.skip("native kernels unavailable")
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kiln::{op}", "CPU"), op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1024), (16, 64), (3, 5, 36), (7, 13)])
def test_rms_norm(mode, dtype, shape):
    x = (torch.randn(shape) * 3).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    out = ops.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, rms_norm_reference(x, w, 1e-5), **NEAR[dtype])
    summed = torch.randn(shape).to(dtype)
    normed, s = ops.fused_add_rms_norm(x, summed, w, 1e-5)
    torch.testing.assert_close(s, x + summed, **EXACT)
    torch.testing.assert_close(normed, rms_norm_reference(x + summed, w, 1e-5), **NEAR[dtype])


def test_rms_norm_non_contiguous_and_mixed_dtypes(mode):
    x = torch.randn(8, 64)[:, ::2]  # strided
    w = torch.randn(32)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), **CLOSE[torch.float32])
    # bf16 activations with an fp32 weight: the reference's promotion (fp32 result) is kept
    xb = x.bfloat16()
    torch.testing.assert_close(ops.rms_norm(xb, w, 1e-6), rms_norm_reference(xb, w, 1e-6))


def test_rms_norm_nan_propagates(mode):
    x = torch.randn(2, 16)
    x[0, 3] = float("nan")
    out = ops.rms_norm(x, torch.ones(16), 1e-6)
    assert out[0].isnan().all() and not out[1].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary(mode, dtype):
    table = cos_sin_table(300, rope_inv_freq(64, 10000.0, None))
    q = torch.randn(5, 8, 64).to(dtype)
    k = torch.randn(5, 2, 64).to(dtype)
    pos = torch.tensor([0, 7, 299, 3, 128])
    got = ops.rotary_embedding(q, k, pos, table)
    ref = rotary_embedding_reference(q, k, pos, table)
    for a, b in zip(got, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **EXACT)
    # non-contiguous q/k (views of a fused projection)
    qkv = torch.randn(5, 12, 64).to(dtype)
    got = ops.rotary_embedding(qkv[:, :8], qkv[:, 8:10], pos, table)
    ref = rotary_embedding_reference(qkv[:, :8], qkv[:, 8:10], pos, table)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **EXACT)


def test_rotary_position_out_of_range_raises(mode):
    table = cos_sin_table(16, rope_inv_freq(8, 10000.0, None))
    with pytest.raises((IndexError, RuntimeError)):
        ops.rotary_embedding(torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.tensor([16]), table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations(mode, dtype):
    g, u = torch.randn(3, 2816).to(dtype), torch.randn(3, 2816).to(dtype)
    torch.testing.assert_close(ops.silu_mul(g, u), silu_mul_reference(g, u), **NEAR[dtype])
    torch.testing.assert_close(ops.silu_mul(g[:, ::2], u[:, ::2]), silu_mul_reference(g[:, ::2], u[:, ::2]),
                               **NEAR[dtype])
    # the rows of a fused gate-up projection (unit stride, row stride 2n), and a length that is no multiple of 8
    gu = torch.randn(3, 2 * 2821).to(dtype)
    gate, up = gu[:, :2821], gu[:, 2821:]
    torch.testing.assert_close(ops.silu_mul(gate, up), silu_mul_reference(gate, up), **NEAR[dtype])
    torch.testing.assert_close(ops.silu_mul(g * 40, u), silu_mul_reference(g * 40, u), **NEAR[dtype])
    for approx in ("none", "tanh"):
        torch.testing.assert_close(ops.gelu(g, approx), gelu_reference(g, approx), **EXACT)
    with pytest.raises(ValueError, match="approximate"):
        ops.gelu(g, "sigmoid")


# ---------------------------------------------------------------------------------------------
# paged attention: native decode kernel and the torch fallback against the reference


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    block_size=st.sampled_from([1, 4, 16]),
    num_kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([4, 8, 12, 64, 128]),
    decode=st.lists(st.integers(0, 70), min_size=1, max_size=6),
    sliding_window=st.sampled_from([0, 1, 5, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    pool_dtype=st.sampled_from([None, torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn]),
    nan_garbage=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_paged_decode_vs_reference(mode, block_size, num_kv_heads, group, head_dim, decode, sliding_window, dtype,
                                   pool_dtype, nan_garbage, seed):
    quantized = pool_dtype in (torch.int8, torch.float8_e4m3fn)
    case = build_case(block_size, head_dim, num_kv_heads, group, [(c, 1) for c in decode], sliding_window, dtype,
                      1, 2, seed, nan_garbage=nan_garbage, pool_dtype=pool_dtype if quantized else None)
    if pool_dtype is not None and not quantized:  # a pool whose dtype differs from the activations'
        case["kv_cache"] = case["kv_cache"].to(pool_dtype)
    out, ref, kc, rc = run_both(case)
    assert out.dtype == dtype and out.shape == case["q"].shape
    assert not out.isnan().any()
    tol = TOL[torch.bfloat16] if torch.bfloat16 in (dtype, case["kv_cache"].dtype) else TOL[torch.float32]
    torch.testing.assert_close(out, ref, **tol)
    assert_same_pool(kc, rc)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    block_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 4]),
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 18)), min_size=1, max_size=4),
    sliding_window=st.sampled_from([0, 3, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    quantized=st.sampled_from([None, torch.int8]),
    seed=st.integers(0, 1000),
)
def test_paged_short_sequences_vs_reference(mode, block_size, group, seqs, sliding_window, dtype, quantized, seed):
    """Sequences of up to 16 new tokens (a speculative verify) run on the decode kernel, one row per token, each
    over its own causal prefix; longer ones (17, 18 here) on SDPA: both match the reference."""
    case = build_case(block_size, 64, 2, group, seqs, sliding_window, dtype, 1, 2, seed, nan_garbage=True,
                      pool_dtype=quantized)
    out, ref, kc, rc = run_both(case)
    assert not out.isnan().any()
    tol = TOL[torch.bfloat16] if torch.bfloat16 in (dtype, case["kv_cache"].dtype) else TOL[torch.float32]
    torch.testing.assert_close(out, ref, **tol)
    assert_same_pool(kc, rc)


def test_paged_mixed_batch_and_zero_length(mode):
    # context sequences, decode ones and a sequence with no new token this step
    case = build_case(4, 16, 2, 2, [(3, 6), (0, 2), (9, 1), (0, 1), (17, 1)], 0, torch.float32, 0, 1, seed=4,
                      nan_garbage=True)
    out, ref, kc, rc = run_both(case)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(kc, rc, rtol=0, atol=0, equal_nan=True)


def test_paged_non_contiguous_qkv(mode):
    case = build_case(4, 16, 2, 2, [(5, 1), (12, 1)], 0, torch.float32, 0, 0, seed=8)
    t = case["q"].shape[0]
    qkv = torch.randn(t, 8, 16)
    case.update(q=qkv[:, :4], k=qkv[:, 4:6], v=qkv[:, 6:8])
    out, ref, kc, rc = run_both(case)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(kc, rc, rtol=0, atol=0)


def test_paged_bad_slot_raises(mode):
    case = build_case(4, 8, 1, 1, [(2, 1)], 0, torch.float32, 0, 0, seed=1)
    case["slot_mapping"] = torch.tensor([10_000])
    with pytest.raises((IndexError, RuntimeError)):
        ops.paged_attention(**case)


def test_native_and_torch_paths_agree():
    if not native_op_ready("paged_attention"):
        pytest.skip("native kernels unavailable")
    case = build_case(16, 64, 4, 4, [(0, 7)] + [(c, 1) for c in (100, 3, 47, 15)], 0, torch.float32, 0, 2, seed=2,
                      nan_garbage=True)
    c1, c2 = case["kv_cache"].clone(), case["kv_cache"].clone()
    native = ops.paged_attention(**{**case, "kv_cache": c1})
    with native_kernels_disabled():
        torch_out = ops.paged_attention(**{**case, "kv_cache": c2})
    torch.testing.assert_close(native, torch_out, **TOL[torch.float32])
    torch.testing.assert_close(c1, c2, rtol=0, atol=0, equal_nan=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 5), width=st.sampled_from([1, 7, 8, 100, 4095, 4097, 9000, 32000]),
       special=st.sampled_from(["none", "ties", "nan", "neg_inf", "pos_inf"]), seed=st.integers(0, 1000))
def test_argmax_rows_is_torch_argmax(mode, rows, width, special, seed):
    """The greedy token of each row, as torch.argmax(dim=1) gives it: the first of equal maxima, the first NaN of a
    row that has one, index 0 of a row of -inf; across the pieces the kernel splits a row into."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    picks = torch.randint(0, width, (rows, 3), generator=g)
    for r in range(rows):
        if special == "ties":
            x[r, picks[r]] = x[r].max() + 1
        elif special == "nan":
            x[r, picks[r, :2]] = float("nan")
        elif special == "neg_inf":
            x[r] = float("-inf")
        elif special == "pos_inf":
            x[r, picks[r]] = float("inf")
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=1))
    # a strided view and a bf16 row (the torch path) answer the same
    wide = torch.randn(rows, 2 * width, generator=g)
    assert torch.equal(ops.argmax_rows(wide[:, ::2]), wide[:, ::2].argmax(dim=1))
    assert torch.equal(ops.argmax_rows(x.bfloat16()), x.bfloat16().argmax(dim=1))


@pytest.mark.parametrize("isa", [256, 512])
@pytest.mark.parametrize("head_dim, group", [(64, 4), (128, 2), (96, 3), (32, 8), (256, 1)])
def test_paged_decode_bf16_on_both_vector_paths(isa, head_dim, group):
    """bf16 queries over a bf16 pool: on AVX-512 BF16 CPUs the dot products run on vdpbf16ps (keys transposed in
    registers, weights rounded to bf16), elsewhere (and with the panel ISA forced to AVX2) every row is widened to
    fp32; both against the reference, over contexts that end inside a 16-position tile and cross blocks, with NaN in
    every slot no sequence wrote, and a sliding window."""
    from kiln.plugins import native

    if not native_op_ready("paged_attention"):
        pytest.skip("native kernels unavailable")
    if isa == 512 and native.set_panel_isa(0) != 512:
        pytest.skip("this CPU has no AVX-512")
    assert native.set_panel_isa(isa) == isa
    try:
        for window in (0, 37):
            case = build_case(16, head_dim, 2, group, [(c, 1) for c in (1, 15, 16, 17, 200, 333)], window,
                              torch.bfloat16, 1, 2, seed=head_dim + group + window, nan_garbage=True)
            out, ref, kc, rc = run_both(case)
            assert not out.isnan().any()
            torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])
            assert_same_pool(kc, rc)
    finally:
        native.set_panel_isa(0)


@pytest.mark.parametrize("isa", [256, 512])
@pytest.mark.parametrize("dtype, pool_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.float32, torch.int8), (torch.float32, torch.float8_e4m3fn),
                                               (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("contexts, window, softcap", [((300,), 0, 0.0), ((700,), 333, 0.0), ((1000,), 0, 30.0),
                                                        ((255, 600, 20), 0, 0.0), ((256, 1000), 77, 0.0)])
def test_paged_decode_long_contexts_read_by_spans(isa, dtype, pool_dtype, contexts, window, softcap):
    """Decode rows are read a whole slot (every kv head) at a time when there are as many rows as threads, and a
    lone row of at least attn_span_context (256) positions with spare threads is split into one part per thread
    whose softmax parts are merged: against the reference with one thread (no split), two (split) and the tunable
    off, fp32 queries over every pool dtype and bf16 ones over bf16 (on AVX-512 BF16: the dot-product path) and
    int8 pools, NaN in every slot no sequence wrote."""
    from kiln.plugins import native

    if not native_op_ready("paged_attention"):
        pytest.skip("native kernels unavailable")
    if isa == 512 and native.set_panel_isa(0) != 512:
        pytest.skip("this CPU has no AVX-512")
    from kiln.plugins import tuning

    quantized = pool_dtype in (torch.int8, torch.float8_e4m3fn)
    threads = torch.get_num_threads()
    lib = native.library()
    span = tuning.get(lib, "attn_span_context")
    assert native.set_panel_isa(isa) == isa
    try:
        for n, span_context in ((1, 256), (2, 256), (2, 0)):   # 0: one kv head per work item, as short rows
            torch.set_num_threads(n)
            tuning.set_value(lib, "attn_span_context", span_context)
            case = build_case(16, 64, 4, 4, [(c, 1) for c in contexts], window, dtype, 1, 2,
                              seed=len(contexts) + n, nan_garbage=True, softcap=softcap,
                              pool_dtype=pool_dtype if quantized else None)
            if not quantized:
                case["kv_cache"] = case["kv_cache"].to(pool_dtype)
            out, ref, kc, rc = run_both(case)
            assert not out.isnan().any()
            torch.testing.assert_close(out, ref, **TOL[torch.bfloat16 if torch.bfloat16 in (dtype, pool_dtype)
                                                       else torch.float32])
            assert_same_pool(kc, rc)
    finally:
        torch.set_num_threads(threads)
        tuning.set_value(lib, "attn_span_context", span)
        native.set_panel_isa(0)
