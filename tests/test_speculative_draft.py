"""Speculative decoding with a draft model: greedy outputs are transformers' with and without it (4 families,
24 concurrent mixed-length requests, preemption under a small pool, prefix reuse), sampled outputs with a draft
that is not the target have the target's distribution (chi-square against transformers' exact probabilities:
this is what proves the rejection sampler, since q is not a point mass), seeded requests repeat themselves, both
KV managers' books are exact after every rollback, and a draft of another vocabulary or tokenizer is refused."""

from __future__ import annotations

import math
import random
import shutil
from collections import Counter

import pytest
import torch
from test_speculative import copy_heavy, corpus_prompt, exact_distribution

from kiln.contract import ConfigError
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.draft_model import DraftProposer
from kiln.runtime.kv_cache import cdiv
from kiln.runtime.rejection import rejection_sample

from runtime_support import assert_no_leak, get_engine, hf_greedy

pytestmark = [pytest.mark.xdist_group("runtime"), pytest.mark.usefixtures("hang_watchdog")]


def draft_config(engine, k: int = 4, **extra) -> dict:
    return {"method": "draft_model", "model": str(engine.directory), "num_speculative_tokens": k,
            "disable_by_batch_size": 32, **extra}


def draft_of(checkpoint_dir, family: str, train_steps: int = 0):
    """A 1-layer model of the family with other weights (seed 1) and the same tokenizer: a draft whose
    distribution is not the target's."""
    return get_engine(checkpoint_dir(family, train_steps=train_steps, num_hidden_layers=1, seed=1))


def checked_books(llm) -> list[int]:
    """After every step: each speculating request's block tables (target's and draft's) span exactly its
    computed tokens, the draft's computed tokens are a prefix of the request's, and both managers' books
    balance; returns a counter of the steps that rolled proposals back."""
    ex = llm.executor
    sched, kv, proposer = ex.scheduler, ex.kv, ex.proposer
    assert isinstance(proposer, DraftProposer)
    update = sched.update_from_output
    rolled = proposer.rolled_back
    rollbacks = [0]

    def spy(out, sampled, accepted=None):
        new = update(out, sampled, accepted)
        for i, s in enumerate(out.scheduled):
            if s.num_spec and s.request.request_id in sched.requests:
                rollbacks[0] += len(accepted[i]) < s.num_spec
                table = kv.block_table(s.request.request_id)
                assert len(table) == max(1, cdiv(s.request.num_computed_tokens, kv.block_size)), s.request
        return new

    def rolled_spy(requests):
        rolled(requests)
        for req in requests:
            seq = proposer._seqs.get(req.request_id)
            if seq is None or req.request_id not in sched.requests:
                continue
            assert not seq.fed and seq.num_computed_tokens < req.num_tokens
            table = proposer.kv.block_table(req.request_id)
            assert len(table) == max(1, cdiv(seq.num_computed_tokens, proposer.kv.block_size)), req
        kv.check_consistency()
        proposer.kv.check_consistency()

    sched.update_from_output = spy
    proposer.rolled_back = rolled_spy
    return rollbacks


def assert_no_draft_leak(llm) -> None:
    assert_no_leak(llm)
    kv = llm.executor.proposer.kv
    kv.check_consistency()
    assert kv.num_used_blocks == 0, f"{kv.num_used_blocks} draft blocks still referenced after every request ended"
    assert not llm.executor.proposer._seqs


def greedy_matches_hf(llm, ckpt, prompts, max_tokens) -> None:
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens])
    bad = [f"request {i}: kiln {o.token_ids} != hf {hf_greedy(ckpt, p, m, ignore_eos=True)}"
           for i, (p, m, o) in enumerate(zip(prompts, max_tokens, outs))
           if o.token_ids != hf_greedy(ckpt, p, m, ignore_eos=True)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2"])
def test_greedy_24_concurrent_requests_match_transformers(checkpoint_dir, family):
    ckpt = checkpoint_dir(family)
    prompts = copy_heavy(24, seed=11)
    max_tokens = [random.Random(i).randint(2, 30) for i in range(24)]
    with LLM(get_engine(ckpt), speculative_config=draft_config(draft_of(checkpoint_dir, family), adaptive=False),
             max_batch_size=8) as llm:
        rollbacks = checked_books(llm)
        greedy_matches_hf(llm, ckpt, prompts, max_tokens)
        assert_no_draft_leak(llm)
        spec = llm.stats()["speculative"]
        assert spec["proposed_tokens"] > 24 and rollbacks[0] > 0, spec


def test_greedy_outputs_with_the_adaptive_policy_match_transformers(checkpoint_dir):
    """The cost-aware policy on (its k follows this machine's timings): still transformers' tokens, books exact."""
    ckpt = checkpoint_dir("llama", train_steps=60)
    prompts = [corpus_prompt(ckpt)[: 8 + i] for i in range(12)] + copy_heavy(12, seed=16)
    max_tokens = [random.Random(90 + i).randint(8, 30) for i in range(24)]
    with LLM(get_engine(ckpt), speculative_config=draft_config(draft_of(checkpoint_dir, "llama", 60)),
             max_batch_size=8) as llm:
        checked_books(llm)
        greedy_matches_hf(llm, ckpt, prompts, max_tokens)
        assert_no_draft_leak(llm)
        assert llm.stats()["speculative"]["proposed_tokens"] > 0


def test_the_target_as_its_own_draft_accepts_its_proposals(checkpoint_dir):
    """Greedy with the target as the draft: the draft's argmax is the target's (up to near-ties of a random model),
    so nearly every proposal is accepted and the outputs are still transformers'."""
    ckpt = checkpoint_dir("llama")
    engine = get_engine(ckpt)
    prompts = copy_heavy(8, seed=12)
    with LLM(engine, speculative_config=draft_config(engine, adaptive=False), max_batch_size=4) as llm:
        checked_books(llm)
        greedy_matches_hf(llm, ckpt, prompts, [24] * 8)
        spec = llm.stats()["speculative"]
        assert spec["acceptance_rate"] > 0.9 and spec["mean_tokens_per_step"] > 2.5, spec
        assert_no_draft_leak(llm)


def test_preemption_and_prefix_reuse_keep_greedy_outputs(checkpoint_dir):
    ckpt = checkpoint_dir("llama", train_steps=60)
    prompts = [corpus_prompt(ckpt)[: 8 + i] for i in range(12)] + copy_heavy(12, seed=13)
    max_tokens = [random.Random(70 + i).randint(4, 30) for i in range(24)]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    with LLM(get_engine(ckpt), speculative_config=draft_config(draft_of(checkpoint_dir, "llama", 60), adaptive=False),
             capacity_policy="max_utilization", max_kv_cache_tokens=longest + 16) as llm:
        checked_books(llm)
        released = []
        release = llm.executor.proposer.release
        llm.executor.proposer.release = lambda reqs: released.extend(reqs) or release(reqs)
        greedy_matches_hf(llm, ckpt, prompts, max_tokens)
        assert llm.stats()["counters"]["preemptions"] > 0 and released
        greedy_matches_hf(llm, ckpt, prompts[:8], max_tokens[:8])   # again: their prefixes are cached in both pools
        assert llm.stats()["kv_cache"]["prefix_hits"] > 0
        assert llm.executor.proposer.kv.prefix_hits > 0
        assert llm.stats()["speculative"]["accepted_tokens"] > 0
        assert_no_draft_leak(llm)


def test_stops_logprobs_and_n_as_without_speculation(checkpoint_dir):
    ckpt = checkpoint_dir("llama", train_steps=60)
    engine = get_engine(ckpt)
    prompts = [corpus_prompt(ckpt)] * 2 + copy_heavy(4, seed=14)
    config = draft_config(draft_of(checkpoint_dir, "llama", 60), adaptive=False)
    with LLM(engine) as plain, LLM(engine, speculative_config=config) as spec:
        full = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2))
        got = spec.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2))
        for a, b in zip(full, got):
            assert a.token_ids == b.token_ids and a.text == b.text
            assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs]
            assert all(math.isclose(a.logprobs[j][t], b.logprobs[j][t], abs_tol=1e-3)
                       for j, t in enumerate(a.token_ids))
        assert spec.stats()["speculative"]["accepted_tokens"] > 0
        for p, f in zip(prompts, full):
            params = dict(temperature=0, max_tokens=24, stop_token_ids=[f.token_ids[5]], ignore_eos=True)
            (a,) = plain.generate([p], SamplingParams(**params))
            (b,) = spec.generate([p], SamplingParams(**params))
            assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason)
        outs = spec.generate(prompts * 2, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
        assert [o.token_ids for o in outs] == [f.token_ids[:7] for f in full * 2]
        # sampled, with logprobs: each emitted token's logprob is transformers' for it after the tokens before it
        outs = spec.generate(prompts, SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, logprobs=0,
                                                     seed=5))
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        for p, o in zip(prompts, outs):
            assert len(o.logprobs) == len(o.token_ids) == 12
            with torch.no_grad():
                lp = model(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1].log_softmax(dim=1)
            want = [float(lp[j, t]) for j, t in enumerate(o.token_ids)]
            got = [o.logprobs[j][t] for j, t in enumerate(o.token_ids)]
            assert all(math.isclose(a, b, abs_tol=2e-3) for a, b in zip(got, want)), (got, want)
        assert_no_draft_leak(spec)


def test_sampled_tokens_have_the_target_distribution(checkpoint_dir):
    """4000 unseeded samples of the first 3 tokens, proposed by a different (1-layer, other weights) draft and
    verified by rejection sampling, against transformers' exact probabilities: chi-square at 1e-4."""
    ckpt = checkpoint_dir("llama", train_steps=60)
    prompt = corpus_prompt(ckpt)
    top_k, n = 3, 4000
    exact = exact_distribution(ckpt, prompt, 3, top_k)
    config = draft_config(draft_of(checkpoint_dir, "llama", 60), k=3, adaptive=False)
    with LLM(get_engine(ckpt), speculative_config=config, seed=0, max_batch_size=8) as llm:
        outs = llm.generate([prompt] * n, SamplingParams(temperature=1.0, top_k=top_k, max_tokens=4, ignore_eos=True))
        spec = llm.stats()["speculative"]
        assert_no_draft_leak(llm)
    assert spec["proposed_tokens"] > n and 0.1 < spec["acceptance_rate"] < 0.95, spec
    assert_chi_square(Counter(tuple(o.token_ids[:3]) for o in outs), exact, n)


def assert_chi_square(seen: Counter, exact: dict, n: int) -> None:
    assert set(seen) <= set(exact), set(seen) - set(exact)
    cells = [c for c in exact if exact[c] * n >= 5]
    rest = 1.0 - sum(exact[c] for c in cells)
    stat = sum((seen[c] - n * exact[c]) ** 2 / (n * exact[c]) for c in cells)
    if rest * n >= 5:
        other = n - sum(seen[c] for c in cells)
        stat += (other - n * rest) ** 2 / (n * rest)
    dof = len(cells) - (0 if rest * n >= 5 else 1)
    # Wilson-Hilferty: the chi-square quantile at 1 - 1e-4 (z = 3.719)
    limit = dof * (1 - 2 / (9 * dof) + 3.719 * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < limit, f"chi-square {stat:.1f} >= {limit:.1f} ({dof} dof): {seen.most_common(8)}"


def test_rejection_sample_emits_the_target_distribution():
    """The sampler alone, on a 6-token vocabulary: q puts mass where p has none and too little where p has
    much; 20000 draws of the first emitted token (accepted d_0, or the residual's) follow p."""
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.3, 0.3]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.2, 0.2, 0.2]])
    g = torch.Generator().manual_seed(0)
    n, first, accepted = 20000, Counter(), 0
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=g))
        a, token = rejection_sample(p, q, [d], g)
        first[d if a else token] += 1
        accepted += a
    exact = {(t,): float(p[0, t]) for t in range(6) if p[0, t] > 0}
    assert_chi_square(Counter({(t,): c for t, c in first.items()}), exact, n)
    assert abs(accepted / n - float(torch.minimum(p[0], q[0]).sum())) < 0.02   # P(accept) = sum min(p, q)


def test_seeded_requests_repeat_themselves(checkpoint_dir):
    ckpt = checkpoint_dir("llama", train_steps=60)
    prompts = [corpus_prompt(ckpt)] * 4 + copy_heavy(4, seed=15)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.0 if s % 2 else 1.1, presence_penalty=0.2 * (s % 3))
              for s in range(len(prompts))]
    config = draft_config(draft_of(checkpoint_dir, "llama", 60))
    runs = []
    for order in (list(range(8)), list(range(8))[::-1]):
        with LLM(get_engine(ckpt), speculative_config=config, max_batch_size=1) as llm:
            outs = llm.generate([prompts[i] for i in order], [params[i] for i in order])
            runs.append({i: o.token_ids for i, o in zip(order, outs)})
            stats = llm.stats()["speculative"]
            assert 0 < stats["accepted_tokens"] < stats["proposed_tokens"], stats
    assert runs[0] == runs[1]


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(checkpoint_dir, tmp_path):
    target = get_engine(checkpoint_dir("llama"))
    other_vocab = get_engine(checkpoint_dir("llama", vocab_size=640, num_hidden_layers=1))
    other_tok = get_engine(checkpoint_dir("llama", tokenizer="sentencepiece", num_hidden_layers=1))
    with pytest.raises(ConfigError, match=rf"draft engine {other_vocab.directory} has a vocabulary of 640 tokens, "
                                          rf"the target engine {target.directory} 512"):
        LLM(target, speculative_config=draft_config(other_vocab))
    with pytest.raises(ConfigError, match=rf"draft engine {other_tok.directory} and the target engine "
                                          rf"{target.directory} have different tokenizers \(tokenizer.json: sha256:"):
        LLM(target, speculative_config=draft_config(other_tok))
    lora = get_engine(checkpoint_dir("llama", num_hidden_layers=1), lora_target_modules="q_proj", max_lora_rank=4)
    with pytest.raises(ConfigError, match="built to take LoRA adapters; a draft runs the base model only"):
        LLM(target, speculative_config=draft_config(lora))
    with pytest.raises(ConfigError, match="is not a directory"):
        LLM(target, speculative_config=draft_config(target) | {"model": str(tmp_path / "nope")})
    broken = tmp_path / "broken"
    shutil.copytree(target.directory, broken)
    (broken / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot be loaded as a draft engine"):
        LLM(target, speculative_config=draft_config(target) | {"model": str(broken)})
    with pytest.raises(ConfigError, match="method 'draft_model' needs model"):
        LLM(target, speculative_config={"method": "draft_model"})
