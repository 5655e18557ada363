"""Each pass: the graph changes as intended (structure) and the logits do not (numerics)."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.builder import BuildConfig, trace
from kiln.builder.passes import (
    PASS_NAMES,
    PassContext,
    check_names,
    dead_code,
    fuse_add_norm,
    merge_gate_up,
    merge_qkv,
    run_passes,
)
from kiln.builder.passes.common import attr, count_gemms, weights_bytes
from kiln.model_defs import build_model, load_checkpoint

from paged_batch import PagedBatcher

BUILD = BuildConfig(max_batch_size=4, max_num_tokens=64, max_input_len=32, max_seq_len=64, tokens_per_block=4,
                    gather_all_logits=True)
STEPS = [[("a", [5, 9, 14, 3, 7, 11]), ("b", [8, 2, 4])], [("c", [6, 6, 1, 9, 10]), ("a", [12]), ("b", [13])]]


def _traced(path, dtype=torch.float32, build=BUILD):
    cfg, weights = load_checkpoint(path, dtype)
    model = build_model(cfg, weights)
    return cfg, trace.export(model, cfg, build).module()


@pytest.fixture(scope="module")
def llama(checkpoint_dir):
    return _traced(checkpoint_dir("llama"))


@pytest.fixture(scope="module")
def qwen2(checkpoint_dir):  # q/k/v biases, tied embeddings
    return _traced(checkpoint_dir("qwen2"))


def run_steps(gm, cfg, dtype=torch.float32):
    b = PagedBatcher(cfg, 32, BUILD.tokens_per_block, dtype=dtype)
    with torch.no_grad():
        return torch.cat([gm(**b.step(step, all_logits=True)) for step in STEPS])


def targets(gm, op):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def apply(gm, module, build=BUILD, cfg=None):
    out = copy.deepcopy(gm)
    stats = module.run(out, PassContext(build=build, model=cfg.to_dict() if cfg else {}))
    out.recompile()
    out.graph.lint()
    return out, stats


@pytest.mark.parametrize("fixture", ["llama", "qwen2"])
def test_merge_qkv(fixture, request):
    cfg, gm = request.getfixturevalue(fixture)
    new, stats = apply(gm, merge_qkv, cfg=cfg)
    assert stats["merged"] == cfg.num_layers
    assert count_gemms(new) == count_gemms(gm) - 2 * cfg.num_layers
    fused = [n for n in new.graph.nodes if n.op == "get_attr" and "qkv_proj" in n.target]
    assert len(fused) == cfg.num_layers * (2 if cfg.attention_bias else 1)  # weight (+ bias)
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    w = getattr(new, [n.target for n in fused if n.target.endswith("weight")][0])
    assert tuple(w.shape) == (qkv_rows, cfg.hidden_size)
    torch.testing.assert_close(run_steps(new, cfg), run_steps(gm, cfg), atol=1e-5, rtol=1e-5)


def test_merge_gate_up(llama):
    cfg, gm = llama
    new, stats = apply(gm, merge_gate_up, cfg=cfg)
    assert stats["merged"] == cfg.num_layers
    assert count_gemms(new) == count_gemms(gm) - cfg.num_layers
    torch.testing.assert_close(run_steps(new, cfg), run_steps(gm, cfg), atol=1e-5, rtol=1e-5)


def test_fuse_add_norm(llama):
    cfg, gm = llama
    rms, fused_op = torch.ops.kiln.rms_norm.default, torch.ops.kiln.fused_add_rms_norm.default
    new, stats = apply(gm, fuse_add_norm, cfg=cfg)
    # every pre-norm after a residual add: 2 per layer minus the first layer's input norm (on the embedding)
    assert stats["fused"] == 2 * cfg.num_layers - 1
    assert len(targets(new, fused_op)) == 2 * cfg.num_layers - 1
    assert len(targets(new, rms)) == len(targets(gm, rms)) - stats["fused"]
    # residual adds left: the last layer's output add (it feeds the final norm through the logits gather)
    assert len(targets(new, torch.ops.aten.add.Tensor)) == 1
    torch.testing.assert_close(run_steps(new, cfg), run_steps(gm, cfg), atol=1e-5, rtol=1e-5)


def test_dead_code_and_cse(llama):
    cfg, gm = llama
    new = copy.deepcopy(gm)
    graph = new.graph
    emb = next(n for n in graph.nodes if n.target is torch.ops.aten.embedding.default)
    first_norm = next(n for n in graph.nodes if n.target is torch.ops.kiln.rms_norm.default)
    with graph.inserting_after(first_norm):
        dup = graph.call_function(torch.ops.kiln.rms_norm.default, first_norm.args)  # duplicate of first_norm
    with graph.inserting_after(dup):
        dead = graph.call_function(torch.ops.aten.mul.Tensor, (emb, 2.0))  # never used
    # route one reader of first_norm through the duplicate
    reader = next(u for u in first_norm.users if u is not dup)
    reader.replace_input_with(first_norm, dup)
    attn_before = len(targets(new, torch.ops.kiln.paged_attention.default))
    new.recompile()
    stats = dead_code.run(new)
    new.recompile()
    assert stats["cse_merged"] >= 1 and stats["dce_removed"] >= 1
    assert dead not in new.graph.nodes and dup not in new.graph.nodes
    # paged attention mutates the KV pool: never merged or removed
    assert len(targets(new, torch.ops.kiln.paged_attention.default)) == attn_before == cfg.num_layers
    torch.testing.assert_close(run_steps(new, cfg), run_steps(gm, cfg), atol=0, rtol=0)


def test_cse_keeps_mutating_ops():
    def f(x, cache):
        a = torch.ops.aten.add_.Tensor(cache, x)  # mutating: not pure
        b = torch.ops.aten.add_.Tensor(cache, x)
        return a + b

    gm = torch.fx.symbolic_trace(f)
    assert dead_code.cse(gm) == 0


def test_run_passes_all_and_disabled(qwen2):
    cfg, gm = qwen2
    ctx = PassContext(build=BUILD, model=cfg.to_dict())
    full = copy.deepcopy(gm)
    stats = run_passes(full, ctx)
    assert set(stats) == set(PASS_NAMES)
    assert count_gemms(full) == count_gemms(gm) - 3 * cfg.num_layers  # q/k/v -> 1, gate/up -> 1 per layer
    # the original per-projection weights are gone from the module (no double weights in the engine)
    names = {name for name, _ in full.named_buffers()} | {name for name, _ in full.named_parameters()}
    assert not any("q_proj" in n or "gate_proj" in n for n in names)
    assert weights_bytes(full) == weights_bytes(gm)
    torch.testing.assert_close(run_steps(full, cfg), run_steps(gm, cfg), atol=1e-5, rtol=1e-5)

    partial = copy.deepcopy(gm)
    stats = run_passes(partial, ctx, disabled=["merge_qkv"])
    assert stats["merge_qkv"] == "disabled"
    assert count_gemms(partial) == count_gemms(gm) - cfg.num_layers
    with pytest.raises(ValueError, match="unknown pass name"):
        check_names(["merge_qkv", "fuse_everything"])


def _plugin_or_skip():
    return pytest.importorskip("kiln.plugins.linear")


@pytest.mark.parametrize("mode, bits", [("int8_weight_only", 8), ("int4_weight_only", 4)])
def test_weight_only_quant(llama, mode, bits):
    _plugin_or_skip()
    from kiln.builder.passes import weight_only_quant

    cfg, gm = llama
    build = BUILD.replace(quantization=mode, group_size=32)
    new, stats = apply(gm, weight_only_quant, build=build, cfg=cfg)
    op = torch.ops.kiln.weight_only_linear.default
    assert stats["quantized_gemms"] == count_gemms(gm)
    # the weights of the tiny Llama all fit the panels: int8 [out/16, in/2, 16, 2], int4 [out/16, in/8, 64]
    assert stats["packed"] == count_gemms(gm)
    qshapes = [attr(new, n.args[1].target).dim() for n in targets(new, op)]
    assert qshapes == [4 if bits == 8 else 3] * len(qshapes)
    assert len(targets(new, op)) == count_gemms(gm) and len(targets(new, torch.ops.aten.linear.default)) == 0
    assert all(n.args[4] == bits for n in targets(new, op))
    # the embedding table, gathered and dequantized: int8 rows + a scale per row, or int4 rows (two per byte) + a
    # scale per group of the engine's group size
    assert stats["quantized_embeddings"] == 1
    tables = [attr(new, n.args[0].target) for n in targets(new, torch.ops.aten.embedding.default)]
    assert {t.dtype for t in tables} == {torch.int8 if bits == 8 else torch.uint8, torch.float32} and len(tables) == 2
    assert all(t.shape[0] == cfg.vocab_size for t in tables)
    widths = sorted(t.shape[1] for t in tables)
    assert widths == ([1, cfg.hidden_size] if bits == 8 else [cfg.hidden_size // 32, cfg.hidden_size // 2])
    assert stats["weights_bytes_after"] < stats["weights_bytes_before"]
    got, ref = run_steps(new, cfg), run_steps(gm, cfg)
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < (0.05 if bits == 8 else 0.4), rel   # int4 g32 weights and token table on a tiny random model
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= (0.9 if bits == 8 else 0.5)


def test_fast_linear(checkpoint_dir, llama):
    _plugin_or_skip()
    from kiln.builder.passes import fast_linear

    cfg, gm = llama  # fp32 -> kiln.fp32_linear
    new, stats = apply(gm, fast_linear, cfg=cfg)
    assert stats["replaced"] == {"float32": count_gemms(gm)}
    assert len(targets(new, torch.ops.kiln.fp32_linear.default)) == count_gemms(gm)
    assert len(targets(new, torch.ops.aten.linear.default)) == 0
    # every weight of the tiny Llama fits the 16-row panels: all are stored packed, none twice
    assert stats["packed"] == count_gemms(gm) and stats["plain"] == 0
    shapes = [tuple(attr(new, n.args[1].target).shape) for n in targets(new, torch.ops.kiln.fp32_linear.default)]
    assert all(len(s) == 3 and s[2] == 16 for s in shapes), shapes
    assert weights_bytes(new) == weights_bytes(gm)
    torch.testing.assert_close(run_steps(new, cfg), run_steps(gm, cfg), atol=1e-5, rtol=1e-5)

    bf16 = BUILD.replace(dtype="bfloat16")
    cfg, gm = _traced(checkpoint_dir("llama"), torch.bfloat16, bf16)
    new, stats = apply(gm, fast_linear, build=bf16, cfg=cfg)
    assert stats["replaced"] == {"bfloat16": count_gemms(gm)}
    assert len(targets(new, torch.ops.kiln.bf16_linear.default)) == count_gemms(gm)
    got, ref = run_steps(new, cfg, torch.bfloat16), run_steps(gm, cfg, torch.bfloat16)
    assert ((got - ref).abs().max() / ref.abs().max()) < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_linear_packs_a_tied_lm_head_once(checkpoint_dir, dtype):
    """gpt2's lm_head is its token table: packed into panels once, and the lookup gathers its rows from them."""
    _plugin_or_skip()
    from kiln.builder.passes import fast_linear

    build = BUILD.replace(dtype=str(dtype).removeprefix("torch."))
    cfg, gm = _traced(checkpoint_dir("gpt2"), dtype, build)
    new, stats = apply(gm, fast_linear, build=build, cfg=cfg)
    assert stats["plain"] == 0 and stats["packed"] == count_gemms(gm) and stats["tied_lookups"] == 1
    assert weights_bytes(new) == weights_bytes(gm)   # stored once
    from kiln.plugins.weight_format import unpack_panels

    table = attr(new, "lm_head_packed")
    assert torch.equal(unpack_panels(table), attr(gm, "embed_tokens.weight"))
    assert len(targets(new, torch.ops.aten.embedding.default)) == 1   # the positions' table only
    got, ref = run_steps(new, cfg, dtype), run_steps(gm, cfg, dtype)
    # a wrong row in the lookup moves the logits by ~100%; the kernels' summation order by ~1e-7 (fp32) or 1e-2
    assert ((got - ref).abs().max() / ref.abs().max()) < (1e-5 if dtype == torch.float32 else 0.02)


def test_inline_plugins(llama):
    from kiln.builder.passes import inline_plugins

    cfg, gm = llama
    compiled = BUILD.replace(backend="cpu-compiled")
    fused, _ = apply(gm, fuse_add_norm, cfg=cfg)
    new, stats = apply(fused, inline_plugins, build=compiled, cfg=cfg)
    assert stats["inlined"] == {"rms_norm": 2, "fused_add_rms_norm": 2 * cfg.num_layers - 1,
                                "rotary_embedding": cfg.num_layers, "silu_mul": cfg.num_layers}
    kiln_ops = {str(n.target) for n in new.graph.nodes
                if n.op == "call_function" and str(n.target).startswith("kiln.")}
    assert kiln_ops == {"kiln.paged_attention.default"}  # only attention stays a plugin
    torch.testing.assert_close(run_steps(new, cfg), run_steps(gm, cfg), atol=1e-5, rtol=1e-5)
    # after a re-export the graph holds aten ops only (plus attention)
    ep = trace.export(new, cfg, compiled)
    targets_after = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "kiln.paged_attention.default" in targets_after
    assert not any(t.startswith("kiln.") and "paged_attention" not in t for t in targets_after)
    assert "skipped" in inline_plugins.run(copy.deepcopy(gm), PassContext(build=BUILD, model={}))


@pytest.mark.parametrize("width, group", [(1024, 128), (160, 32), (96, 32), (32, 32)])
def test_int4_token_table_dequantizes_exactly(width, group):
    """The graph ops that dequantize gathered int4 table rows give quantize_int4's reconstruction bit for bit, for
    widths with whole 64-blocks, a tail, or only a tail."""
    from torch import fx

    from kiln.builder.passes.weight_only_quant import _dequantize_int4_rows
    from kiln.plugins import weight_format as fmt

    w = torch.randn(50, width, generator=torch.Generator().manual_seed(width))
    q, scales = fmt.quantize_int4(w, group)
    want = (fmt.unpack_int4(q).float().reshape(50, -1, group) * scales[..., None]).reshape(50, width)
    graph = fx.Graph()
    graph.output(_dequantize_int4_rows(graph, graph.placeholder("rows"), graph.placeholder("scales"), width, group))
    got = fx.GraphModule(torch.nn.Module(), graph)(q, scales)
    assert torch.equal(got, want)
