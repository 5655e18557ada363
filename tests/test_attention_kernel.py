"""kiln's causal attention kernel (plugins/csrc/attention_kernels.cpp) against attention in fp32 from its
definition: whole prompts and continuation chunks, GQA ratios, head dims, sizes that do not fill a block, the
cases it declines, the route setting, and paged attention's context path through it. bf16 runs both its product
routes where the CPU has AMX-BF16 (tiles, and the vdpbf16ps loop every other AVX-512 BF16 CPU runs)."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.plugins import attention
from kiln.plugins import native as native_lib


def _reference(q, k, v, scale):
    n, hq, _ = q.shape
    ctx, hkv, _ = k.shape
    qq = q.float().transpose(0, 1)
    kk = k.float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
    vv = v.float().transpose(0, 1).repeat_interleave(hq // hkv, 0)
    visible = torch.arange(ctx)[None] <= torch.arange(ctx - n, ctx)[:, None]
    scores = (qq @ kk.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, -1) @ vv).transpose(0, 1)


@pytest.fixture(params=["amx", "avx512"])
def kernel(native, request):
    lib = native_lib.library()
    if not lib.kiln_causal_attention_available():
        pytest.skip("this CPU has no AVX-512 BF16: context attention runs SDPA")
    amx_before = attention.set_amx(request.param == "amx")
    if request.param == "amx" and not lib.kiln_causal_attention_amx():
        attention.set_amx(amx_before)
        pytest.skip("no AMX-BF16 tile state on this CPU (or the OS refused it): bf16 runs vdpbf16ps")
    old = attention.set_kernel_route("kiln")
    yield request.param
    attention.set_kernel_route(old)
    attention.set_amx(amx_before)


@pytest.mark.parametrize("n, ctx, hq, hkv, d", [
    (1, 1, 1, 1, 64),        # one token, one key
    (5, 5, 4, 1, 64),        # fewer rows than one micro-block, MQA
    (17, 40, 8, 2, 128),     # a continuation: 17 new tokens after 23 cached
    (100, 100, 16, 4, 64),   # a whole prompt, GQA 4
    (63, 200, 4, 4, 64),     # MHA, a long cached prefix
    (130, 131, 2, 1, 256),   # head 256, a context one key longer than a block boundary needs
    (64, 64, 3, 3, 64),      # exactly one key block
    (700, 1300, 8, 2, 64),   # many blocks, a continuation
    (33, 97, 6, 2, 128),     # GQA 3: a micro-block of rows spans positions mid-group
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_attention_in_fp32(kernel, n, ctx, hq, hkv, d, dtype):
    torch.manual_seed(n * 1000 + ctx)
    q, k, v = torch.randn(n, hq, d).to(dtype), torch.randn(ctx, hkv, d).to(dtype), torch.randn(ctx, hkv, d).to(dtype)
    scale = 1 / math.sqrt(d)
    out = attention.causal_attention(q, k, v, scale)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    ref = _reference(q, k, v, scale)
    # bf16: its output (2^-9 relative) plus P rounded to bf16 for the P V products; fp32: sums in another order
    tol = 0.01 * ref.abs().max().item() + 1e-3 if dtype == torch.bfloat16 else 1e-5 * ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= tol


def test_large_scores_do_not_overflow(kernel):
    torch.manual_seed(1)
    q, k = (torch.randn(40, 2, 64) * 30).bfloat16(), (torch.randn(90, 2, 64) * 30).bfloat16()
    v = torch.randn(90, 2, 64).bfloat16()
    out = attention.causal_attention(q, k, v, 0.125)
    assert torch.isfinite(out.float()).all()
    ref = _reference(q, k, v, 0.125)
    assert (out.float() - ref).abs().max().item() < 0.05


@pytest.mark.parametrize("step", [0.005, 0.3])
def test_scores_rising_across_key_blocks(kernel, step):
    """Scores that grow along the keys: by less than the AMX path's lazy margin over a block (step 0.005: its P
    grows up to 2^8 before the reference max moves) and by far more (0.3: the max moves at every block)."""
    torch.manual_seed(4)
    ctx, n = 300, 120
    q = torch.ones(n, 2, 64).bfloat16()
    k = (torch.arange(ctx).float()[:, None, None] * step * torch.ones(ctx, 1, 64) / 8).bfloat16()
    v = torch.randn(ctx, 1, 64).bfloat16()
    out = attention.causal_attention(q, k, v, 1.0)
    ref = _reference(q, k, v, 1.0)
    assert (out.float() - ref).abs().max().item() <= 0.01 * ref.abs().max().item() + 1e-3


def test_each_query_sees_only_its_prefix(kernel):
    """Changing the keys and values past a query's position must not change that query's output (finite values:
    a NaN in a later value reaches the earlier queries of its key block through 0 * NaN, as in SDPA's kernel)."""
    torch.manual_seed(2)
    q, k, v = torch.randn(50, 4, 64).bfloat16(), torch.randn(80, 2, 64).bfloat16(), torch.randn(80, 2, 64).bfloat16()
    a = attention.causal_attention(q, k, v, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[60:] = 7.0
    v2[60:] = 1e4  # keys no query before position 60 sees
    b = attention.causal_attention(q, k2, v2, 0.125)
    first = 60 - (80 - 50)  # query i sits at position 30 + i: queries 0..29 sit before key 60
    assert torch.equal(a[:first], b[:first]) and not torch.equal(a[first], b[first])


@pytest.mark.parametrize("case", ["fp16", "mixed dtypes", "head 80", "fewer keys than queries", "heads not a multiple"])
def test_declined_cases_return_none(kernel, case):
    q, k, v = torch.randn(8, 4, 64).bfloat16(), torch.randn(8, 2, 64).bfloat16(), torch.randn(8, 2, 64).bfloat16()
    if case == "fp16":
        q, k, v = q.half(), k.half(), v.half()
    elif case == "mixed dtypes":
        k = k.float()
    elif case == "head 80":
        q, k, v = torch.randn(8, 4, 80).bfloat16(), torch.randn(8, 2, 80).bfloat16(), torch.randn(8, 2, 80).bfloat16()
    elif case == "fewer keys than queries":
        k, v = k[:4], v[:4]
    else:
        q = torch.randn(8, 3, 64).bfloat16()
    assert attention.causal_attention(q, k, v, 0.125) is None


def test_route_setting(native, monkeypatch):
    old = attention.set_kernel_route("sdpa")
    try:
        q = torch.randn(8, 2, 64).bfloat16()
        assert attention.causal_attention(q, q.clone(), q.clone(), 0.125) is None
        with pytest.raises(ValueError, match="choose one of auto, kiln, sdpa"):
            attention.set_kernel_route("fast")
        monkeypatch.setenv("KILN_ATTENTION", "turbo")
        attention.set_kernel_route("auto")  # chosen again, from the environment
        with pytest.raises(ValueError, match="KILN_ATTENTION='turbo'"):
            attention.kernel_route()
        monkeypatch.setenv("KILN_ATTENTION", "sdpa")
        assert attention.kernel_route() == "sdpa"
    finally:
        monkeypatch.delenv("KILN_ATTENTION", raising=False)
        attention.set_kernel_route(old)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 0.02), (torch.float32, 1e-5)])
def test_paged_attention_context_path_uses_it(kernel, dtype, tol):
    """A prompt and a continuation through the paged attention op agree with its fp32 reference."""
    from kiln.plugins.paged_attention import paged_attention, paged_attention_reference

    torch.manual_seed(3)
    hq, hkv, d, bs, blocks = 8, 2, 64, 16, 24
    kv_cache = torch.zeros(1, 2, blocks, bs, hkv, d, dtype=dtype)
    seq_lens = torch.tensor([120, 37], dtype=torch.int32)       # a whole prompt, then a continuation
    context_lens = torch.tensor([120, 37 + 80], dtype=torch.int32)
    block_tables = torch.tensor([list(range(0, 12)), list(range(12, 24))], dtype=torch.int32)
    # the continuation's first 80 tokens are already in its blocks
    prefix_k, prefix_v = torch.randn(80, hkv, d).to(dtype), torch.randn(80, hkv, d).to(dtype)
    flat = kv_cache[0].view(2, blocks * bs, hkv, d)
    flat[0, 12 * bs:12 * bs + 80], flat[1, 12 * bs:12 * bs + 80] = prefix_k, prefix_v
    t = int(seq_lens.sum())
    q, k, v = (torch.randn(t, hkv if i else hq, d).to(dtype) for i in range(3))
    slots = torch.cat([torch.arange(120), torch.arange(12 * bs + 80, 12 * bs + 117)]).long()
    cache_ref = kv_cache.clone()
    out = paged_attention(q, k, v, kv_cache, 0, seq_lens, context_lens, block_tables, slots, 0.125, 0, 0.0)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), cache_ref.float(), 0, seq_lens, context_lens,
                                    block_tables, slots, 0.125, 0, 0.0)
    assert (out.float() - ref.float()).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, ctx", [(70, 70), (33, 150)])   # a prompt; a chunk after 117 cached (a partial block)
def test_paged_reads_the_pool_in_place(kernel, dtype, n, ctx):
    """Keys and values read through a scattered block table give exactly what the same keys and values gathered
    first give, written into the given output; a table entry outside the pool is declined (None), not read."""
    torch.manual_seed(n + ctx)
    hq, hkv, d, bs, blocks = 8, 2, 64, 16, 20
    pool = torch.randn(2, blocks, bs, hkv, d).to(dtype)
    used = -(-ctx // bs)
    table = torch.randperm(blocks)[:used].to(torch.int32)
    gathered = pool[:, table.long()].reshape(2, used * bs, hkv, d)[:, :ctx]
    q = torch.randn(n, hq, d).to(dtype)
    want = attention.causal_attention(q, gathered[0].contiguous(), gathered[1].contiguous(), 0.125)
    out = torch.full_like(q, float("nan"))
    got = attention.causal_attention_paged(q, pool[0], pool[1], table, ctx, 0.125, out)
    assert got is out and torch.equal(out, want)
    assert torch.equal(attention.causal_attention_paged(q, pool[0], pool[1], table, ctx, 0.125), want)
    bad = table.clone()
    bad[-1] = blocks
    assert attention.causal_attention_paged(q, pool[0], pool[1], bad, ctx, 0.125) is None
    assert attention.causal_attention_paged(q, pool[0], pool[1], table[:-1], ctx, 0.125) is None   # too few blocks


def test_paged_op_with_scattered_blocks(kernel):
    """The paged op's context path (the kernel reading the pool in place) with blocks out of order matches the
    op's fp32 reference."""
    from kiln.plugins.paged_attention import paged_attention, paged_attention_reference

    torch.manual_seed(5)
    hq, hkv, d, bs, blocks = 4, 2, 128, 16, 16
    kv_cache = torch.zeros(1, 2, blocks, bs, hkv, d, dtype=torch.bfloat16)
    seq_lens = torch.tensor([50, 1], dtype=torch.int32)   # a prompt beside a decode row
    context_lens = torch.tensor([50, 9], dtype=torch.int32)
    block_tables = torch.tensor([[9, 2, 14, 5], [7, 0, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([int(block_tables[0, p // bs]) * bs + p % bs for p in range(50)] + [7 * bs + 8]).long()
    q, k, v = (torch.randn(51, hkv if i else hq, d).bfloat16() for i in range(3))
    cache_ref = kv_cache.clone()
    out = paged_attention(q, k, v, kv_cache, 0, seq_lens, context_lens, block_tables, slots, 0.1, 0, 0.0)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), cache_ref.float(), 0, seq_lens, context_lens,
                                    block_tables, slots, 0.1, 0, 0.0)
    assert (out.float() - ref.float()).abs().max().item() < 0.02


def test_describe_names_the_route_and_why(kernel):
    assert attention.describe("bfloat16", 64).startswith("kiln causal attention kernel")
    products = "AMX tile products" if kernel == "amx" else "AVX-512 BF16 dot products"
    assert products in attention.describe("bfloat16", 64)
    assert "fp32 FMA" in attention.describe("float32", 128)
    assert "this engine: float16, head dim 64" in attention.describe("float16", 64)
    assert "head dim 80" in attention.describe("bfloat16", 80)
    assert "soft-capped" in attention.describe("bfloat16", 256, softcap=50.0)
    attention.set_kernel_route("sdpa")
    assert attention.describe("bfloat16", 64).startswith("torch SDPA (")
