"""kiln's packed-token modules against Hugging Face transformers on the same random checkpoints.

Two checks per model case:

* logits: a packed prefill of 3 sequences of different lengths, then 16 steps in which new
  sequences join (one of them as a 2-chunk prefill) while the others decode, every step a
  mixed batch laid out as the contract says (context sequences first, then decode ones);
  every logit row is compared with HF's forward over that sequence alone;
* greedy generation: 32 tokens for prompts of different lengths, run batched through kiln
  (one of them joining late), equal token for token to HF ``generate(do_sample=False)``.

Tolerances are the README's ("Numerical tolerances"); MoE in bf16 has its own rule (``check_moe_bf16``).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from kiln.model_defs import build_model, load_checkpoint

from paged_batch import PagedBatcher

BLOCK_SIZE = 4
NUM_BLOCKS = 96
FP32_ATOL = 1e-4
BF16_REL = 0.05  # × max |logit| of the fp32 HF reference (README)

# id -> (family, checkpoint overrides, checkpoint kwargs). Between them: llama3 and linear rope
# scaling, a sharded checkpoint, a sliding window shorter than the sequences, tied and untied
# embeddings, GQA (tiny preset: 4 heads / 2 kv heads), MQA and MHA, a head_dim that is not
# hidden/heads, Llama's optional biases, GPT-2's Conv1D/LayerNorm/GELU.
CASES = {
    "llama-llama3-sharded": ("llama", {}, {"shard_size": "100KB"}),
    "llama-linear-mqa-bias": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0},
                                        "num_key_value_heads": 1, "head_dim": 32,  # 4 heads × 32 != hidden 64
                                        "attention_bias": True, "mlp_bias": True}, {}),
    "mistral-window8": ("mistral", {"sliding_window": 8}, {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}, {}),
    "qwen2-untied-mha": ("qwen2", {"tie_word_embeddings": False, "num_key_value_heads": 4}, {}),
    "gpt2": ("gpt2", {}, {}),
    "qwen3-window-layer1": ("qwen3", {}, {}),
    "gemma2-softcap-window-layer0": ("gemma2", {}, {}),
    "gemma3-local-rope": ("gemma3", {}, {}),
    "phi3-fused-longrope-partial": ("phi3", {}, {}),
    "mixtral-8x-top2-window": ("mixtral", {}, {}),
    "qwen3moe-16x-top4-dense0": ("qwen3_moe", {}, {}),
}

_hf_cache: dict[tuple, torch.nn.Module] = {}
_kiln_cache: dict[tuple, torch.nn.Module] = {}


@pytest.fixture(params=list(CASES))
def case(request, checkpoint_dir):
    family, overrides, kwargs = CASES[request.param]
    return request.param, checkpoint_dir(family, **kwargs, **overrides)


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    key = (str(path), dtype)
    if key not in _hf_cache:
        _hf_cache[key] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return _hf_cache[key]


def kiln_model(path, dtype=torch.float32):
    key = (str(path), dtype)
    if key not in _kiln_cache:
        _kiln_cache[key] = build_model(*load_checkpoint(path, dtype))
    return _kiln_cache[key]


def new_batcher(model, dtype, seed=0) -> PagedBatcher:
    cfg = model.config
    return PagedBatcher(cfg, NUM_BLOCKS, BLOCK_SIZE, dtype=dtype, seed=seed)


def run_step(model, batcher, entries, all_logits):
    with torch.no_grad():
        inputs = batcher.step(entries, all_logits=all_logits)
        return model(**inputs)


# ---------------------------------------------------------------------------------------------
# A schedule of mixed steps: which sequence gets which new tokens at each of the 17 calls.

PROMPTS = {"A": 5, "B": 11, "C": 16}  # step 0: three context sequences packed (C = 4 full blocks)
LATE = {3: ("D", [8]), 6: ("E", [5, 7]), 10: ("F", [9]), 15: ("G", [2])}  # step -> (seq, prefill chunks)
NUM_STEPS = 17  # the prefill, then 16 mixed steps


def schedule() -> list[list[tuple[str, int]]]:
    """Per step, [(seq, number of new tokens)]: context entries first, then decode entries."""
    steps = []
    pending: dict[str, list[int]] = {}
    decoding: list[str] = []
    for s in range(NUM_STEPS):
        if s == 0:
            pending.update({name: [n] for name, n in PROMPTS.items()})
        if s in LATE:
            name, chunks = LATE[s]
            pending[name] = list(chunks)
        context = [(name, chunks.pop(0)) for name, chunks in pending.items()]
        steps.append(context + [(name, 1) for name in decoding])
        for name, chunks in list(pending.items()):
            if not chunks:
                del pending[name]
                decoding.append(name)
    return steps


def test_schedule_covers_the_contract_cases():
    steps = schedule()
    assert [n for _, n in steps[0]] == [5, 11, 16]
    assert len(steps) == NUM_STEPS
    # later steps mix context (including a chunk with a context offset) and decode entries, context first
    mixed = [s for s in steps[1:] if any(n > 1 for _, n in s) and any(n == 1 for _, n in s)]
    assert len(mixed) >= 4
    for s in steps:
        kinds = [n > 1 for _, n in s]
        assert kinds == sorted(kinds, reverse=True)
    assert ("E", 7) in steps[7]  # second chunk of E: 7 new tokens after 5 cached


def check_logit_parity(path, dtype, with_hf_dtype=False, per_position=False):
    """Per sequence, the max abs logit error of kiln in ``dtype`` against transformers fp32, and the largest fp32
    logit; ``with_hf_dtype``: transformers' own errors in ``dtype`` too; ``per_position``: also the max error of each
    compared position, kiln's and transformers' (in ``dtype``), as two 1-D tensors."""
    model = kiln_model(path, dtype)
    vocab = model.config.vocab_size
    steps = schedule()
    totals: dict[str, int] = {}
    for entries in steps:
        for name, n in entries:
            totals[name] = totals.get(name, 0) + n
    rng = random.Random(1)
    tokens = {name: [rng.randrange(3, vocab) for _ in range(n)] for name, n in totals.items()}
    assert max(totals.values()) > 16  # long enough to slide past a window of 8

    batcher = new_batcher(model, dtype)
    got: dict[str, dict[int, torch.Tensor]] = {name: {} for name in totals}
    done = {name: 0 for name in totals}
    for i, entries in enumerate(steps):
        all_logits = i % 2 == 0  # alternate: logits for every row / only the last row of each sequence
        batch = [(name, tokens[name][done[name] : done[name] + n]) for name, n in entries]
        logits = run_step(model, batcher, batch, all_logits)
        assert logits.dtype == torch.float32
        row = 0
        for name, n in entries:
            positions = range(done[name], done[name] + n) if all_logits else [done[name] + n - 1]
            for p in positions:
                got[name][p] = logits[row]
                row += 1
            done[name] += n
        assert row == logits.shape[0]

    ref32 = hf_model(path, torch.float32)
    errors, hf_errors, scale, rows, hf_rows = {}, {}, 0.0, [], []
    for name, toks in tokens.items():
        with torch.no_grad():
            ref = ref32(torch.tensor([toks])).logits[0].float()
            same_dtype = hf_model(path, dtype)(torch.tensor([toks])).logits[0].float() if with_hf_dtype else None
        scale = max(scale, ref.abs().max().item())
        pos = sorted(got[name])
        mine = torch.stack([got[name][p] for p in pos])
        errors[name] = (mine - ref[pos]).abs().max().item()
        rows.append((mine - ref[pos]).abs().amax(-1))
        if with_hf_dtype:
            hf_errors[name] = (same_dtype - ref).abs().max().item()
            hf_rows.append((same_dtype - ref)[pos].abs().amax(-1))
    if per_position:
        return errors, scale, hf_errors, torch.cat(rows), torch.cat(hf_rows)
    return (errors, scale, hf_errors) if with_hf_dtype else (errors, scale)


def test_logits_match_transformers_fp32(case):
    name, path = case
    errors, scale = check_logit_parity(path, torch.float32)
    assert scale > 1.0, "reference logits are too small for the comparison to mean anything"
    assert max(errors.values()) <= FP32_ATOL, f"{name}: max abs logit error per sequence {errors}"


def test_logits_match_transformers_bf16(case):
    name, path = case
    if kiln_model(path).config.is_moe:
        return check_moe_bf16(name, path)
    errors, scale, hf_errors = check_logit_parity(path, torch.bfloat16, with_hf_dtype=True)
    # the README's bound, against the fp32 truth
    assert max(errors.values()) <= BF16_REL * scale, (
        f"{name}: bf16 max abs error per sequence {errors} > {BF16_REL} × {scale:.3f}"
    )
    # and kiln in bf16 is no further from it than transformers' own bf16 forward, give or take
    assert max(errors.values()) <= 1.5 * max(hf_errors.values()), (
        f"{name}: kiln bf16 errors {errors} vs transformers bf16 errors {hf_errors}"
    )


def check_moe_bf16(name, path):
    """MoE in bf16: a router near-tie flips a token's expert choice (transformers' own bf16 forward flips some too),
    and a flipped choice moves that position's logits far beyond any rounding bound. So the bound holds for most
    positions, as many as for transformers in bf16 (less 5 points), and the typical error is transformers'."""
    _, scale, _, rows, hf_rows = check_logit_parity(path, torch.bfloat16, with_hf_dtype=True, per_position=True)
    share, hf_share = ((r <= BF16_REL * scale).float().mean().item() for r in (rows, hf_rows))
    print(f"\n{name}: bf16 positions within {BF16_REL} x max |logit|: kiln {share:.1%}, transformers {hf_share:.1%}; "
          f"median error kiln {rows.median():.4f}, transformers {hf_rows.median():.4f}")
    assert share >= 0.9 and share >= hf_share - 0.05, (name, share, hf_share)
    assert rows.median() <= 1.5 * hf_rows.median(), (name, rows.median(), hf_rows.median())


def test_cases_exercise_their_features(checkpoint_dir):
    """Each case's checkpoint really has the feature it is meant to test (transformers renames keys)."""
    def cfg(name):
        family, overrides, kwargs = CASES[name]
        return load_checkpoint(checkpoint_dir(family, **kwargs, **overrides))[0]

    assert cfg("llama-llama3-sharded").rope_scaling["rope_type"] == "llama3"
    c = cfg("llama-linear-mqa-bias")
    assert c.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert (c.num_kv_heads, c.head_dim, c.attention_bias, c.attention_out_bias, c.mlp_bias) == (1, 32, True, True, True)
    assert cfg("mistral-window8").sliding_window == 8
    assert cfg("qwen2-tied").tie_word_embeddings and cfg("qwen2-tied").attention_bias
    assert not cfg("qwen2-untied-mha").tie_word_embeddings and cfg("qwen2-untied-mha").num_kv_heads == 4
    assert cfg("gpt2").hidden_act == "gelu_new" and cfg("gpt2").attention_bias
    c = cfg("qwen3-window-layer1")
    assert (c.layer_types, c.sliding_window, c.window_of(0), c.window_of(1)) == (
        ["full_attention", "sliding_attention"], 8, 0, 8)
    assert not c.tie_word_embeddings
    c = cfg("gemma2-softcap-window-layer0")
    assert (c.window_of(0), c.window_of(1), c.attn_logit_softcapping, c.final_logit_softcapping) == (8, 0, 1.0, 5.0)
    assert c.attention_scale == 24**-0.5 and c.hidden_act == "gelu_pytorch_tanh"
    c = cfg("gemma3-local-rope")
    assert (c.window_of(0), c.window_of(1), c.rope_theta, c.local_rope_theta) == (8, 0, 1e6, 1e4)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 4.0} and c.local_rope_scaling is None
    assert (c.attn_logit_softcapping, c.final_logit_softcapping, c.tie_word_embeddings) == (0.0, 6.0, False)
    c = cfg("phi3-fused-longrope-partial")
    assert (c.sliding_window, c.layer_types, c.rotary_dim, c.head_dim) == (8, [], 8, 16)
    assert c.rope_scaling["rope_type"] == "longrope" and c.rope_scaling["original_max_position_embeddings"] == 256
    c = cfg("mixtral-8x-top2-window")
    assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, c.moe_layers, c.sliding_window) == (
        8, 2, True, [0, 1], 8)
    c = cfg("qwen3moe-16x-top4-dense0")
    assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, c.moe_layers, c.moe_intermediate_size) == (
        16, 4, False, [1], 32)


def test_sharded_checkpoint_is_sharded(checkpoint_dir):
    family, overrides, kwargs = CASES["llama-llama3-sharded"]
    path = checkpoint_dir(family, **kwargs, **overrides)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()
    config, _ = load_checkpoint(path)
    assert config.rope_scaling and config.rope_scaling["rope_type"] == "llama3"


def test_sliding_window_is_exercised(checkpoint_dir):
    """Mistral's window must change the logits, or the parity test would not check it."""
    path = checkpoint_dir("mistral", sliding_window=8)
    model = kiln_model(path)
    assert model.config.sliding_window == 8
    windowed = build_model(*load_checkpoint(path))
    for layer in windowed.layers:
        layer.self_attn.sliding_window = 0
    toks = [(0, list(range(3, 23)))]
    a = run_step(model, new_batcher(model, torch.float32), toks, True)
    b = run_step(windowed, new_batcher(model, torch.float32), toks, True)
    assert torch.allclose(a[:8], b[:8], atol=1e-5)  # positions inside the window agree
    assert (a[8:] - b[8:]).abs().max() > 1e-2  # later ones see fewer keys


# ---------------------------------------------------------------------------------------------
# Greedy generation

GEN_PROMPTS = [3, 9, 16, 6]  # lengths; the last one joins at step 4, as a 2-chunk prefill
GEN_TOKENS = 32


def hf_greedy(path, prompt: list[int]) -> list[int]:
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def kiln_greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    model = kiln_model(path)
    batcher = new_batcher(model, torch.float32, seed=3)
    late = len(prompts) - 1
    pending = {i: [p] for i, p in enumerate(prompts) if i != late}  # seq -> prefill chunks to go
    out: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(o) < GEN_TOKENS for o in out):
        if step == 4:
            half = len(prompts[late]) // 2
            pending[late] = [prompts[late][:half], prompts[late][half:]]
        context = [(i, chunks.pop(0)) for i, chunks in pending.items()]
        decode = [(i, [out[i][-1]]) for i in range(len(prompts))
                  if out[i] and i not in pending and len(out[i]) < GEN_TOKENS]
        logits = run_step(model, batcher, context + decode, all_logits=False)
        for row, (i, _) in enumerate(context + decode):
            if i in pending and pending[i]:
                continue  # a prefill chunk that is not the last: its logits are not a prediction
            pending.pop(i, None)
            out[i].append(int(logits[row].argmax()))
        step += 1
    return out


def test_greedy_generation_matches_transformers(case):
    name, path = case
    vocab = kiln_model(path).config.vocab_size
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in GEN_PROMPTS]
    got = kiln_greedy(path, prompts)
    refs = []
    for prompt, mine in zip(prompts, got):
        ref = hf_greedy(path, prompt)
        assert len(ref) == GEN_TOKENS
        refs.append(ref)
        first = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        assert mine == ref, f"{name}: prompt of {len(prompt)} tokens diverges at {first}"
    assert len({t for ref in refs for t in ref}) >= 10, "degenerate references: the comparison would be weak"
