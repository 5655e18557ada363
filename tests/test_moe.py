"""kiln::moe against its dense reference and transformers' sparse MoE blocks: float, panel, int8 and int4 experts,
the C++ kernel and the torch path, decode (one token) and prefill, and that a step reads only its chosen experts."""

from __future__ import annotations

import importlib

import pytest
import torch

import kiln.plugins  # noqa: F401  (registers torch.ops.kiln.*)
from kiln.plugins import weight_format as wf
from kiln.plugins.native import native_kernels_disabled, native_op_ready

M = importlib.import_module("kiln.plugins.moe")   # the module (the package exports the op under its name)
ops = torch.ops.kiln
H, INTER, E = 32, 24, 6


def experts(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(E, H, INTER, generator=g) / INTER**0.5).to(dtype)
    return router, gate_up, down


def stacked(ws, fn):
    parts = [fn(w) for w in ws]
    return tuple(torch.stack(p) for p in zip(*parts)) if isinstance(parts[0], tuple) else torch.stack(parts)


def formats(gate_up, down):
    """(name, gate_up, gate_up_scales, down, down_scales, bits, group) in every layout the builder stores."""
    yield "float", gate_up, None, down, None, 0, 0
    if gate_up.shape[1] % 16 == 0 and down.shape[1] % 16 == 0:
        yield "float panels", stacked(gate_up, wf.pack_panels), None, stacked(down, wf.pack_panels), None, 0, 0
    q8 = [stacked(w.float(), wf.quantize_int8) for w in (gate_up, down)]
    yield "int8", q8[0][0], q8[0][1], q8[1][0], q8[1][1], 8, 0
    yield ("int8 panels", stacked(q8[0][0], wf.pack_panels), q8[0][1], stacked(q8[1][0], wf.pack_panels), q8[1][1],
           8, 0)
    q4 = [stacked(w.float(), lambda m: wf.quantize_int4(m, 8)) for w in (gate_up, down)]
    yield "int4", q4[0][0], q4[0][1], q4[1][0], q4[1][1], 4, 8


@pytest.fixture(params=["native", "torch"])
def path(request):
    if request.param == "native":
        if not native_op_ready("moe"):
            pytest.skip("native kernels unavailable")
        yield "native"
    else:
        with native_kernels_disabled():
            yield "torch"


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
QUANT_TOL = dict(atol=2e-4, rtol=2e-3)   # fp32 x times int8/int4 weights: the kernels round x to int16 per row


def tol(dtype, bits):
    return QUANT_TOL if bits and dtype == torch.float32 else TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,renormalize", [(1, 2, True), (1, 1, False), (9, 2, True), (40, 3, False),
                                                      (5, E, True)])
def test_moe_matches_the_dense_reference(path, dtype, tokens, top_k, renormalize):
    router, gate_up, down = experts(tokens, dtype)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    for name, gu, gus, dn, ds, bits, group in formats(gate_up, down):
        args = (x, router, gu, gus, dn, ds, top_k, renormalize, bits, group)
        got, want = ops.moe(*args), M.moe_reference(*args)
        assert got.shape == x.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, **tol(dtype, bits), msg=lambda m: f"{path} {name}: {m}")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_matches_transformers_sparse_blocks(family):
    """transformers' MixtralSparseMoeBlock (renormalized top-k) and Qwen3MoeSparseMoeBlock (norm_topk_prob off)
    on the same weights."""
    import transformers

    from synthetic_checkpoints import hf_config

    cfg = hf_config(family, "tiny", hidden_size=H, **({"intermediate_size": INTER} if family == "mixtral"
                                                        else {"moe_intermediate_size": INTER}),
                    **({"num_local_experts": E} if family == "mixtral" else {"num_experts": E}))
    block = (transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock if family == "mixtral" else
             transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock)(cfg).eval()
    router, gate_up, down = experts(3)
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
        x = torch.randn(1, 11, H, generator=torch.Generator().manual_seed(2))
        want = block(x)[0]
    renormalize = family == "mixtral" or bool(cfg.norm_topk_prob)
    got = ops.moe(x[0], router, gate_up, None, down, None, cfg.num_experts_per_tok, renormalize, 0, 0)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_a_step_reads_only_its_chosen_experts(path):
    """The experts no token chose hold NaN: the result is finite and equals the reference with them zeroed (a
    kernel that read every expert, or multiplied unchosen ones by a zero weight, would return NaN)."""
    router, gate_up, down = experts(5)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(6))
    weights, chosen = M.route(x, router, 2, True)
    unused = sorted(set(range(E)) - set(chosen.flatten().tolist()))
    assert unused, "every expert was chosen: the check would be empty"
    for name, gu, gus, dn, ds, bits, group in formats(gate_up, down):
        clean = [t.clone() for t in (gu, dn)]
        poisoned = [t.clone() for t in (gu, dn)]
        for t in poisoned:
            t[unused] = 0 if t.dtype in (torch.int8, torch.uint8) else float("nan")
        scales = [None if s is None else s.clone() for s in (gus, ds)]
        if bits:   # the quantized weights cannot hold NaN: their scales do
            for s in scales:
                s[unused] = float("nan")
        got = ops.moe(x, router, poisoned[0], scales[0], poisoned[1], scales[1], 2, True, bits, group)
        for t in clean:
            t[unused] = 0
        want = M.moe_reference(x, router, clean[0], gus, clean[1], ds, 2, True, bits, group)
        assert torch.isfinite(got).all(), f"{path} {name}: an unchosen expert was read"
        torch.testing.assert_close(got, want, **tol(torch.float32, bits), msg=lambda m: f"{path} {name}: {m}")


@pytest.mark.parametrize("change,message", [
    (dict(top_k=E + 1), "top_k=7 must be between 1 and the 6 experts"),
    (dict(bits=3), "bits must be 0"),
    (dict(down="short"), "need gate_up"),
    (dict(gate_up_scales="bogus"), "gate_up_scales must be absent"),
    (dict(x="wide"), "x must be [tokens, hidden]"),
])
def test_moe_bad_arguments_are_named(path, change, message):
    router, gate_up, down = experts()
    args = dict(x=torch.randn(4, H), router=router, gate_up=gate_up, gate_up_scales=None, down=down, down_scales=None,
                top_k=2, renormalize=True, bits=0, group_size=0)
    replace = {"short": down[:, :, :-2], "bogus": torch.ones(E, 2 * INTER), "wide": torch.randn(4, H + 1)}
    args.update({k: replace.get(v, v) if isinstance(v, str) else v for k, v in change.items()})
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        ops.moe(**args)


def test_moe_exports_with_a_dynamic_token_count():
    router, gate_up, down = experts(7)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name, t in (("router", router), ("gate_up", gate_up), ("down", down)):
                self.register_buffer(name, t)

        def forward(self, x):
            return ops.moe(x, self.router, self.gate_up, None, self.down, None, 2, True, 0, 0)

    ep = torch.export.export(Block(), (torch.randn(5, H),), dynamic_shapes=({0: torch.export.Dim("t", min=1)},))
    x = torch.randn(13, H)
    torch.testing.assert_close(ep.module()(x), M.moe_reference(x, router, gate_up, None, down, None, 2, True, 0, 0))
