"""The kiln::* plugin ops against their plain-torch references (and transformers where it defines the
math), op registration checks, and a whole model through torch.export with dynamic shapes."""

from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kiln.plugins  # noqa: F401  (registers torch.ops.kiln.*)
from kiln.plugins.activations import gelu_reference, silu_mul_reference
from kiln.plugins.kv_quant import is_quantized, to_pool, writable
from kiln.plugins.rms_norm import rms_norm_reference
from kiln.plugins.rotary import cos_sin_table, rope_inv_freq, rotary_embedding_reference

ops = torch.ops.kiln
pa = importlib.import_module("kiln.plugins.paged_attention")  # the module (the package exports the op by that name)
HYPOTHESIS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------------
# Paged attention


def build_case(block_size, head_dim, num_kv_heads, group, seqs, sliding_window, dtype, layer, spare_blocks,
               seed, pad_with_garbage=True, nan_garbage=False, softcap=0.0, pool_dtype=None):
    """Random inputs for paged_attention; seqs = [(cached, new)], context ones (new > 1) first.

    The pool (of ``pool_dtype``, default ``dtype``; int8 / float8_e4m3fn: the 8-bit layout) starts with the
    cached tokens' K/V in shuffled, non-contiguous blocks; every other slot (other layer, unused blocks, the
    tail of a sequence's last block) holds large garbage, or NaN (uninitialised memory; random bytes in an
    8-bit pool, NaN and infinite scales among them), so reading outside a sequence's context changes the result.
    """
    pool_dtype = pool_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_layers = 2
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + spare_blocks
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(need)
    quantized = is_quantized(pool_dtype)
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim + 2 * quantized)
    if quantized:
        kv_cache = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8).view(pool_dtype)
        if nan_garbage:
            kv_cache.view(torch.int8).fill_(0x7F)   # NaN in e4m3, a 3e38 scale
    else:
        kv_cache = (torch.rand(shape, generator=g) * 200 - 100).to(pool_dtype)
        if nan_garbage:
            kv_cache.fill_(float("nan"))
    tables, slots = [], []
    for (cached, new), nb in zip(seqs, need):
        blocks = [free.pop() for _ in range(nb)]
        pad = [rng.randrange(num_blocks) if pad_with_garbage else 0 for _ in range(width - nb)]
        tables.append(blocks + pad)
        for p in range(cached):  # what earlier steps wrote
            b, o = blocks[p // block_size], p % block_size
            rows = to_pool(torch.randn(2, num_kv_heads, head_dim, generator=g).to(dtype), pool_dtype)
            writable(kv_cache)[layer, :, b, o] = writable(rows)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
    t = sum(n for _, n in seqs)
    q = torch.randn(t, num_kv_heads * group, head_dim, generator=g).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    return dict(
        q=q, k=k, v=v, kv_cache=kv_cache, layer=layer,
        seq_lens=torch.tensor([n for _, n in seqs], dtype=torch.int32),
        context_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        scale=head_dim**-0.5, sliding_window=sliding_window, softcap=softcap,
    )


def run_both(case):
    kernel_cache = case["kv_cache"].clone()
    ref_cache = case["kv_cache"].clone()
    out = ops.paged_attention(**{**case, "kv_cache": kernel_cache})
    ref = pa.paged_attention_reference(**{**case, "kv_cache": ref_cache})
    return out, ref, kernel_cache, ref_cache


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# the native rms_norm / silu_mul against their references: a few fp32 ulps (their own fp32 sum order, their own
# exp), up to two bf16 ulps (an fp32 value that lands on the other side of a bf16 rounding step)
NEAR = {torch.float32: dict(atol=1e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


@st.composite
def attention_cases(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4]))  # 1 = MHA; with 1 kv head = MQA
    head_dim = draw(st.sampled_from([4, 8, 16]))
    context = draw(st.lists(st.tuples(st.integers(0, 13), st.integers(2, 12)), max_size=3))
    decode = draw(st.lists(st.tuples(st.integers(0, 24), st.just(1)), min_size=0 if context else 1, max_size=4))
    seqs = context + decode
    if draw(st.booleans()):  # make one sequence's length an exact multiple of the block size
        i = draw(st.integers(0, len(seqs) - 1))
        cached, new = seqs[i]
        total = max(block_size * max(1, round((cached + new) / block_size)), new)
        total = -(-total // block_size) * block_size
        seqs[i] = (total - new, new)
    return dict(
        block_size=block_size, head_dim=head_dim, num_kv_heads=num_kv_heads, group=group, seqs=seqs,
        sliding_window=draw(st.sampled_from([0, 0, 1, 3, 8])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        layer=draw(st.integers(0, 1)), spare_blocks=draw(st.integers(0, 3)), seed=draw(st.integers(0, 2**16)),
        nan_garbage=draw(st.booleans()), softcap=draw(st.sampled_from([0.0, 0.0, 0.7, 3.0])),
        pool_dtype=draw(st.sampled_from([None, None, torch.int8, torch.float8_e4m3fn])),  # None: q's dtype
    )


@HYPOTHESIS
@given(attention_cases())
@example(dict(block_size=4, head_dim=8, num_kv_heads=2, group=2, seqs=[(0, 8), (4, 4), (7, 1), (3, 1)],
              sliding_window=0, dtype=torch.float32, layer=1, spare_blocks=0, seed=1, nan_garbage=False))  # multiples
@example(dict(block_size=4, head_dim=8, num_kv_heads=2, group=1, seqs=[(3, 1), (9, 1)],
              sliding_window=0, dtype=torch.float32, layer=0, spare_blocks=1, seed=1, nan_garbage=True))  # NaN tails
@example(dict(block_size=4, head_dim=8, num_kv_heads=1, group=4, seqs=[(5, 6), (0, 1), (15, 1)],
              sliding_window=3, dtype=torch.bfloat16, layer=0, spare_blocks=2, seed=2, nan_garbage=False))  # chunk, MQA
@example(dict(block_size=4, head_dim=16, num_kv_heads=2, group=2, seqs=[(5, 6), (0, 1), (15, 1)], sliding_window=0,
              dtype=torch.float32, layer=1, spare_blocks=1, seed=3, nan_garbage=True, softcap=0.7))  # soft-capped
@example(dict(block_size=4, head_dim=16, num_kv_heads=2, group=2, seqs=[(3, 6), (0, 2), (9, 1), (17, 1)],
              sliding_window=5, dtype=torch.float32, layer=1, spare_blocks=1, seed=3, nan_garbage=True,
              pool_dtype=torch.int8))  # 8-bit pool, mixed batch, garbage bytes
@example(dict(block_size=2, head_dim=8, num_kv_heads=1, group=4, seqs=[(4, 3), (6, 1)],
              sliding_window=0, dtype=torch.bfloat16, layer=0, spare_blocks=0, seed=4, nan_garbage=True,
              pool_dtype=torch.float8_e4m3fn))  # fp8 pool, MQA
def test_paged_attention_matches_reference(params):
    case = build_case(**params)
    out, ref, kernel_cache, ref_cache = run_both(case)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    assert not ref.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[params["dtype"]])
    # the pool after the in-place write: same contents, bit for bit (NaN where nothing was written)
    assert_same_pool(kernel_cache, ref_cache)


def assert_same_pool(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two pools hold the same bits (float pools: NaN where nothing was written; 8-bit ones: byte for byte)."""
    assert a.dtype == b.dtype
    if is_quantized(a.dtype):
        assert torch.equal(a.view(torch.int8), b.view(torch.int8))
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_paged_attention_writes_only_its_slots():
    case = build_case(4, 8, 2, 2, [(3, 6), (9, 1), (0, 1)], 0, torch.float32, 1, 2, seed=5)
    before = case["kv_cache"].clone()
    ops.paged_attention(**case)
    after = case["kv_cache"]
    changed = (after != before).flatten(4).any(-1)  # [L, 2, blocks, block_size]
    flat = changed[1].reshape(2, -1)
    assert not changed[0].any(), "another layer was written"
    written = set(flat[0].nonzero().flatten().tolist())
    assert written == set(case["slot_mapping"].tolist())
    flat_k = after[1, 0].reshape(-1, 2, 8)
    torch.testing.assert_close(flat_k[case["slot_mapping"]], case["k"], rtol=0, atol=0)


def test_paged_attention_sliding_window_boundary():
    """Key j is visible to query i iff i - j < window (transformers' sliding_window semantics)."""
    d, window, n = 4, 3, 7
    k = torch.zeros(n, 1, d)
    v = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, 1, d).contiguous()
    case = dict(q=torch.zeros(n, 1, d), k=k, v=v, kv_cache=torch.zeros(1, 2, 2, 4, 1, d), layer=0,
                seq_lens=torch.tensor([n], dtype=torch.int32), context_lens=torch.tensor([n], dtype=torch.int32),
                block_tables=torch.tensor([[1, 0]], dtype=torch.int32),
                slot_mapping=torch.tensor([4 + i if i < 4 else i - 4 for i in range(n)]), scale=1.0,
                sliding_window=window)
    out = ops.paged_attention(**case)[:, 0, 0]
    # equal scores: each query averages the values (= positions) it can see
    expected = torch.tensor([sum(range(max(0, i - window + 1), i + 1)) / min(i + 1, window) for i in range(n)])
    torch.testing.assert_close(out, expected)
    # the same through the decode path: one new token at position n-1
    decode = dict(case, q=case["q"][-1:], k=k[-1:], v=v[-1:], seq_lens=torch.tensor([1], dtype=torch.int32),
                  slot_mapping=case["slot_mapping"][-1:])
    torch.testing.assert_close(ops.paged_attention(**decode)[0, 0, 0], expected[-1])


def test_paged_attention_softcap_changes_the_result_as_transformers_does():
    """Soft-capping is Gemma 2's: scores -> cap * tanh(scores / cap) before the softmax (and it matters)."""
    case = build_case(4, 8, 2, 2, [(3, 6), (9, 1)], 0, torch.float32, 0, 1, seed=7)
    case["q"] = case["q"] * 4   # scores well beyond the cap
    capped, plain = (ops.paged_attention(**{**case, "kv_cache": case["kv_cache"].clone(), "softcap": c})
                     for c in (1.0, 0.0))
    assert (capped - plain).abs().max() > 0.1
    # decode row of the second sequence by hand: its 10 keys, query head 0 reads kv head 0
    kv = case["kv_cache"].clone()
    ops.paged_attention(**{**case, "kv_cache": kv, "softcap": 1.0})
    table, ctx = case["block_tables"][1], 10
    keys = torch.stack([kv[0, 0, table[p // 4], p % 4, 0] for p in range(ctx)])
    values = torch.stack([kv[0, 1, table[p // 4], p % 4, 0] for p in range(ctx)])
    scores = keys @ case["q"][6, 0] * case["scale"]
    want = torch.softmax(torch.tanh(scores / 1.0) * 1.0, 0) @ values
    torch.testing.assert_close(capped[6, 0], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_paged_attention_batches_decode_sequences(monkeypatch, native):
    """No Python loop over tokens: one attention call per context sequence, one for all decode ones
    (the torch path), or none for the decode ones and the short sequences of at most 16 new tokens (the C++
    kernel computes them: a speculative verify)."""
    from kiln.plugins.native import native_kernels_disabled, native_op_ready

    if native and not native_op_ready("paged_attention"):
        pytest.skip("native kernels unavailable")
    calls = []
    sdpa = pa.F.scaled_dot_product_attention
    monkeypatch.setattr(pa.F, "scaled_dot_product_attention",
                        lambda q, *a, **kw: calls.append(tuple(q.shape)) or sdpa(q, *a, **kw))
    seqs = [(0, 20), (4, 17), (2, 3)] + [(c, 1) for c in (3, 8, 16, 30, 2, 7)]
    case = build_case(4, 8, 2, 2, seqs, 0, torch.float32, 0, 0, seed=3)
    if native:
        out, ref, _, _ = run_both(case)
    else:
        with native_kernels_disabled():
            out, ref, _, _ = run_both(case)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    expected = [1, 1] if native else [1, 1, 1, 6]  # [batch, heads, queries, dim]: 2 long (+ 1 short, 6 decode)
    assert sorted(c[0] for c in calls) == expected


# ---------------------------------------------------------------------------------------------
# RMSNorm, rotary, activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = (torch.randn(13, 64) * 3).to(dtype)
    hf = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.normal_()
    w = hf.weight.detach()
    out = ops.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_reference(x, w, 1e-5), **NEAR[dtype])
    torch.testing.assert_close(out, hf(x).detach(), **NEAR[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm(dtype):
    torch.manual_seed(1)
    x, r = torch.randn(9, 32).to(dtype), torch.randn(9, 32).to(dtype)
    w = torch.randn(32).to(dtype)
    normed, summed = ops.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(summed, x + r, rtol=0, atol=0)
    torch.testing.assert_close(normed, rms_norm_reference(x + r, w, 1e-6), **NEAR[dtype])
    assert not torch.equal(normed, rms_norm_reference(x, w, 1e-6))


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("scaling", list(ROPE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_transformers(scaling, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, theta = 32, 50000.0
    rope = dict(ROPE_CASES[scaling] or {"rope_type": "default"}, rope_theta=theta)
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, rope_parameters=rope)
    hf = LlamaRotaryEmbedding(cfg)
    inv_freq = rope_inv_freq(head_dim, theta, ROPE_CASES[scaling])
    torch.testing.assert_close(inv_freq, hf.inv_freq, rtol=1e-6, atol=0)
    if scaling != "default":
        assert not torch.allclose(inv_freq, rope_inv_freq(head_dim, theta, None))

    table = cos_sin_table(512, inv_freq)
    torch.manual_seed(2)
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 97, 300, 511, 63, 64, 65])
    q = torch.randn(len(pos), 4, head_dim).to(dtype)
    k = torch.randn(len(pos), 2, head_dim).to(dtype)
    rq, rk = ops.rotary_embedding(q, k, pos, table)
    eq, ek = rotary_embedding_reference(q, k, pos, table)
    torch.testing.assert_close(rq, eq, rtol=0, atol=0)
    torch.testing.assert_close(rk, ek, rtol=0, atol=0)

    # transformers, in fp32 (in bf16 it rounds cos/sin first, kiln does not)
    cos, sin = hf(q.float(), pos[None])
    hq, hk = apply_rotary_pos_emb(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], cos, sin)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(rq.float(), hq[0].transpose(0, 1), **tol)
    torch.testing.assert_close(rk.float(), hk[0].transpose(0, 1), **tol)


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    torch.manual_seed(3)
    g, u = torch.randn(7, 48).to(dtype), torch.randn(7, 48).to(dtype)
    out = ops.silu_mul(g, u)
    torch.testing.assert_close(out, silu_mul_reference(g, u), **NEAR[dtype])
    torch.testing.assert_close(out.float(), F.silu(g.float()) * u.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_matches_transformers(dtype):
    from transformers.activations import ACT2FN

    torch.manual_seed(4)
    x = (torch.randn(5, 40) * 3).to(dtype)
    for approximate, hf_name in (("tanh", "gelu_new"), ("tanh", "gelu_pytorch_tanh"), ("none", "gelu")):
        out = ops.gelu(x, approximate)
        torch.testing.assert_close(out, gelu_reference(x, approximate), rtol=0, atol=0)
        torch.testing.assert_close(out.float(), ACT2FN[hf_name](x.float()), **TOL[dtype])
    assert not torch.allclose(ops.gelu(x, "tanh"), ops.gelu(x, "none"), atol=0, rtol=0)
    with pytest.raises(ValueError, match="approximate"):
        ops.gelu(x, "sigmoid")


# ---------------------------------------------------------------------------------------------
# Registration: schema (mutation declared), fake kernels agree with the real ones


def opcheck_cases():
    pa_case = build_case(4, 8, 2, 2, [(2, 5), (6, 1), (0, 1)], 3, torch.float32, 1, 1, seed=9)
    x, w = torch.randn(6, 32), torch.randn(32)
    q, k = torch.randn(6, 4, 16), torch.randn(6, 2, 16)
    table = cos_sin_table(64, rope_inv_freq(16, 10000.0, None))
    return {
        "paged_attention": (ops.paged_attention.default, tuple(pa_case.values())),
        "rms_norm": (ops.rms_norm.default, (x, w, 1e-6)),
        "fused_add_rms_norm": (ops.fused_add_rms_norm.default, (x, x.clone(), w, 1e-6)),
        "rotary_embedding": (ops.rotary_embedding.default, (q, k, torch.arange(6), table)),
        "silu_mul": (ops.silu_mul.default, (x, x.clone())),
        "gelu": (ops.gelu.default, (x, "tanh")),
    }


@pytest.mark.parametrize("name", ["paged_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding",
                                  "silu_mul", "gelu"])
def test_opcheck(name):
    op, args = opcheck_cases()[name]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# torch.export with dynamic shapes


def contract_inputs(model, plan, num_blocks, block_size, seed, extra_logits=()):
    from paged_batch import PagedBatcher

    cfg = model.config
    batcher = PagedBatcher(cfg, num_blocks, block_size, seed=seed)
    rng = random.Random(seed)
    for warmup in plan[:-1]:  # earlier steps fill the cache
        with torch.no_grad():
            model(**batcher.step([(s, [rng.randrange(3, cfg.vocab_size) for _ in range(n)]) for s, n in warmup]))
    inputs = batcher.step([(s, [rng.randrange(3, cfg.vocab_size) for _ in range(n)]) for s, n in plan[-1]])
    if extra_logits:
        inputs["logits_indices"] = torch.cat([inputs["logits_indices"], torch.tensor(extra_logits)])
    return inputs


@pytest.mark.parametrize("family", ["mistral", "gpt2"])
def test_model_exports_with_dynamic_shapes(checkpoint_dir, family):
    from torch.export import Dim

    from kiln.contract import INPUT_NAMES
    from kiln.model_defs import load_model

    model = load_model(checkpoint_dir(family))
    block_size = 4
    # traced batch: 2 context sequences (one a chunk after cached tokens) + 3 decode ones; every dynamic
    # size distinct and >= 2 so none is specialised: tokens 12, seqs 5, logits 7, blocks/seq 6, pool 37
    traced = contract_inputs(model, [[(0, 21), (1, 3), (2, 2), (4, 2)], [(3, 6), (4, 3), (0, 1), (1, 1), (2, 1)]],
                             num_blocks=37, block_size=block_size, seed=0, extra_logits=(0, 3))
    assert [traced["input_ids"].shape[0], traced["seq_lens"].shape[0], traced["logits_indices"].shape[0],
            traced["block_tables"].shape[1], traced["kv_cache"].shape[2]] == [12, 5, 7, 6, 37]
    tokens, seqs = Dim("num_tokens", min=1, max=4096), Dim("num_seqs", min=1, max=256)
    logits = Dim("num_logits", min=1, max=4096)
    blocks_per_seq, num_blocks = Dim("max_blocks_per_seq", min=1, max=512), Dim("num_blocks", min=1, max=65536)
    dynamic = {
        "input_ids": {0: tokens}, "position_ids": {0: tokens}, "slot_mapping": {0: tokens},
        "seq_lens": {0: seqs}, "context_lens": {0: seqs}, "block_tables": {0: seqs, 1: blocks_per_seq},
        "logits_indices": {0: logits}, "kv_cache": {2: num_blocks},
    }
    args = tuple(traced[n] for n in INPUT_NAMES)
    exported = torch.export.export(model, args, dynamic_shapes=tuple(dynamic[n] for n in INPUT_NAMES))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert any("kiln.paged_attention" in t for t in targets)

    # another shape: 1 long context chunk + 5 decode sequences (a window-crossing history), bigger pool
    other = contract_inputs(model, [[(s, 4 + 3 * s) for s in range(6)], [(0, 8)] + [(s, 1) for s in range(1, 6)]],
                            num_blocks=61, block_size=block_size, seed=1)
    assert other["input_ids"].shape[0] != 12 and other["kv_cache"].shape[2] != 37
    eager_cache = other["kv_cache"].clone()
    with torch.no_grad():
        want = model(**{**other, "kv_cache": eager_cache})
        got = exported.module()(*(other[n] for n in INPUT_NAMES))
    assert got.shape == want.shape == (6, model.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(other["kv_cache"], eager_cache, rtol=0, atol=0)  # written in place, identically
