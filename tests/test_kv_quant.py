"""The 8-bit KV pool (int8, fp8 = e4m3, a bf16 scale per token and KV head): the row format against its
definition, the C++ kernel's reads and writes against it bit for bit, and attention over a quantized pool
against attention over a float one (GQA/MQA, sliding window and mixed batches run in test_plugins'
hypothesis cases with 8-bit pools)."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_plugins import TOL, build_case, run_both

import kiln.plugins  # noqa: F401
from kiln.plugins.kv_quant import QMAX, ceil_to_bfloat16, from_pool, row_scales, to_pool, writable
from kiln.plugins.native import native_kernels_disabled, native_op_ready, set_panel_isa

ops = torch.ops.kiln
pa = importlib.import_module("kiln.plugins.paged_attention")
POOLS = [torch.int8, torch.float8_e4m3fn]


@pytest.fixture(params=["native-256", "native-512", "torch"])
def mode(request):
    """The C++ kernel at each vector width it has (AVX2; AVX-512 where the CPU has it), or plain torch."""
    if request.param.startswith("native"):
        if not native_op_ready("paged_attention"):
            pytest.skip("native kernels unavailable")
        bits = int(request.param.split("-")[1])
        if bits == 512 and set_panel_isa(0) != 512:
            pytest.skip("no AVX-512 on this CPU")
        assert set_panel_isa(bits) == bits
        yield request.param
        set_panel_isa(0)
    else:
        with native_kernels_disabled():
            yield "torch"


@pytest.mark.parametrize("pool", POOLS)
def test_row_format(pool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, generator=g) * torch.logspace(-6, 4, 64)[:, None, None]   # magnitudes 1e-6 .. 1e4
    x[0, 0] = 0.0                                                                         # an all-zero row
    rows = to_pool(x, pool)
    assert rows.dtype == pool and rows.shape == (64, 3, 34)
    scale = row_scales(rows)
    amax = x.abs().amax(-1, keepdim=True)
    # the scale: max / qmax rounded UP to a bfloat16 (within one bf16 step), never below float32's tiny
    assert torch.equal(scale, ceil_to_bfloat16(scale))
    floor = (amax / QMAX[pool]).clamp_min(torch.finfo(torch.float32).tiny)
    assert (scale >= floor).all() and (scale <= floor * (1 + 2**-7)).all()
    numbers = rows[..., :32].float()
    assert numbers.abs().max() <= QMAX[pool] and numbers[0, 0].abs().max() == 0
    back = from_pool(rows, torch.float32)
    err = (back - x).abs()
    if pool == torch.int8:
        assert (err <= scale / 2 * (1 + 1e-6)).all()                          # round to nearest
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormals below 2^-6 x scale
        assert (err <= torch.maximum(x.abs() * 2**-4, scale * 2**-10)).all()
    assert torch.equal(from_pool(rows[0, 0], torch.float32), torch.zeros(32))


def test_ceil_to_bfloat16():
    x = torch.tensor([1.0, 1.0 + 2**-20, 3.0e-3, 1.0e30, torch.finfo(torch.float32).tiny])
    up = ceil_to_bfloat16(x)
    assert torch.equal(up.to(torch.bfloat16).float(), up) and (up >= x).all()
    assert up[0] == 1.0 and up[1] == 1.0 + 2**-7 and up[4] == x[4]


@pytest.mark.parametrize("pool", POOLS)
def test_a_token_stores_the_same_bytes_however_it_is_batched(mode, pool):
    """Quantization reads one row: a prompt written in one step or in chunks (chunked prefill, a prefix
    computed by another request, a preempted request recomputed) leaves the same bytes in the pool."""
    case = build_case(4, 16, 2, 2, [(0, 11)], 0, torch.float32, 0, 0, seed=7, pool_dtype=pool)
    whole = case["kv_cache"].clone()
    ops.paged_attention(**{**case, "kv_cache": whole})
    chunked = case["kv_cache"].clone()
    for lo, hi in ((0, 3), (3, 4), (4, 11)):   # a chunk, a one-token (decode) step, the rest
        ops.paged_attention(**{**case, "q": case["q"][lo:hi], "k": case["k"][lo:hi], "v": case["v"][lo:hi],
                               "kv_cache": chunked, "seq_lens": torch.tensor([hi - lo], dtype=torch.int32),
                               "context_lens": torch.tensor([hi], dtype=torch.int32),
                               "slot_mapping": case["slot_mapping"][lo:hi]})
    assert torch.equal(whole.view(torch.int8), chunked.view(torch.int8))


@pytest.mark.parametrize("pool", POOLS)
def test_kernel_reads_every_8bit_number_exactly(mode, pool):
    """A cached row holding every finite 8-bit number (scale 1) read back through a decode step: q = 0 gives
    the cached row and the new token (v = 0) equal weights, so the output is exactly half the row."""
    if pool == torch.int8:
        numbers = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    else:
        numbers = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.int8).view(pool)
        numbers = torch.where(numbers.float().isnan(), torch.zeros((), dtype=pool), numbers)
    d = 256
    one = torch.ones(1, dtype=torch.bfloat16).view(torch.int8)
    row = torch.cat([writable(numbers), one])                         # [258]: the numbers and scale 1.0
    pool_t = torch.zeros(1, 2, 1, 4, 1, d + 2, dtype=pool)
    writable(pool_t)[0, :, 0, 0, 0] = row
    out = ops.paged_attention(torch.zeros(1, 2, d), torch.zeros(1, 1, d), torch.zeros(1, 1, d), pool_t, 0,
                              torch.tensor([1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                              torch.tensor([[0]], dtype=torch.int32), torch.tensor([1]), 1.0, 0)
    expected = numbers.float() / 2
    assert torch.equal(out[0, 0], expected) and torch.equal(out[0, 1], expected)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_attention_over_8bit_pool_is_close_to_float(mode, pool, head_dim):
    """Same keys/values through a float32 pool and an 8-bit one (GQA, a context chunk and decode sequences):
    the attention outputs differ by the quantization error only."""
    seqs = [(5, 7), (40, 1), (0, 1), (100, 1)]
    float_case = build_case(16, head_dim, 2, 4, seqs, 0, torch.float32, 1, 1, seed=11)
    pool_case = dict(float_case)
    pool_case["kv_cache"] = to_pool(float_case["kv_cache"], pool)    # the same cached tokens, quantized
    out_f, _, _, _ = run_both(float_case)
    out_q, ref_q, _, _ = run_both(pool_case)
    torch.testing.assert_close(out_q, ref_q, atol=2e-5, rtol=1e-4)
    err = (out_q - out_f).abs().max().item()
    assert err < (0.04 if pool == torch.int8 else 0.2), err   # outputs up to ~3: int8 ~1%, e4m3 ~4%
    assert err > 0                                                    # the 8-bit pool is really 8 bits


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16, *POOLS])
@pytest.mark.parametrize("head_dim", [8, 24, 80])
def test_decode_tiles_match_the_reference(mode, pool, head_dim):
    """Decode over every pool type with head_dims that are not a multiple of the vector width (the kernel pads
    its fp32 tiles), contexts that span several key/value tiles and end inside one, and a sliding window."""
    seqs = [(70, 1), (5, 1), (33, 1), (0, 1)]
    for window in (0, 9):
        case = build_case(4, head_dim, 2, 4, seqs, window, torch.float32, 0, 2, seed=head_dim, pool_dtype=pool)
        out, ref, cache, ref_cache = run_both(case)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])
        assert torch.equal(cache.view(torch.int8), ref_cache.view(torch.int8))


def test_wrong_row_size_is_named(mode):
    case = build_case(4, 16, 2, 2, [(3, 1)], 0, torch.float32, 0, 0, seed=1)
    case["kv_cache"] = torch.zeros(*case["kv_cache"].shape, dtype=torch.int8)   # no room for the scales
    with pytest.raises(ValueError, match=r"not a pool of rows of 18 \(head_dim \+ 2 scale bytes\) for head_dim 16"):
        ops.paged_attention(**case)
