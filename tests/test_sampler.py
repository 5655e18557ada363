"""Sampler: allowed sets of top-k/top-p/min-p (property test), penalties, min_tokens, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.runtime.request import Request
from kiln.runtime.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams


def mkreq(params: SamplingParams, prompt=(3, 4), outputs=(), rid="r", eos=(2,)):
    r = Request(rid, list(prompt), params, params.max_tokens or 16, eos_token_ids=eos)
    for t in outputs:
        r.append_token(t)
    return r


def allowed_set(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Plain-Python definition: temperature, then top-k, then top-p over the renormalised rest, then min-p."""
    x = [v / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = order[:top_k] if top_k > 0 else order
    m = max(x[i] for i in keep)
    z = sum(math.exp(x[i] - m) for i in keep)
    probs = {i: math.exp(x[i] - m) / z for i in keep}
    if top_p < 1.0:
        kept, mass = [], 0.0
        for i in keep:
            if kept and mass >= top_p:
                break
            kept.append(i)
            mass += probs[i]
        keep = kept
    if min_p > 0:
        z = sum(probs[i] for i in keep)
        pmax = max(probs[i] for i in keep) / z
        keep = [i for i in keep if probs[i] / z >= min_p * pmax]
    return set(keep)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(2, 40),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5]),
    top_k=st.integers(0, 10),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.2, 0.05]),
    min_p=st.sampled_from([0.0, 0.05, 0.2, 0.6]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sampled_tokens_stay_in_the_allowed_set(data, vocab, temperature, top_k, top_p, min_p, seed):
    # distinct logits spread well apart (gaps >= 0.05): no ties at the cut-offs
    perm = data.draw(st.permutations(list(range(vocab))))
    logits = [p * 0.37 - 4.0 for p in perm]
    allowed = allowed_set(logits, temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=8)
    sampler = Sampler(vocab, seed=seed)
    reqs = [mkreq(params, rid=str(i), eos=()) for i in range(6)]
    row = torch.tensor(logits, dtype=torch.float32)
    out = sampler(row.repeat(6, 1), reqs)
    assert set(out.token_ids) <= allowed, (out.token_ids, allowed)


def test_truncation_can_reach_every_allowed_token():
    logits = torch.tensor([[4.0, 3.9, 3.8, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=8)
    sampler = Sampler(5, seed=0)
    seen = {sampler(logits, [mkreq(params, eos=())]).token_ids[0] for _ in range(200)}
    assert seen == {0, 1, 2}


def test_greedy_is_argmax_and_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 7.0, 1.0]])
    s = Sampler(6, seed=0)
    assert s(logits, [mkreq(SamplingParams(temperature=0))]).token_ids == [2]
    r = mkreq(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]))
    assert s(logits, [r]).token_ids == [4]
    r = mkreq(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]), outputs=(5, 5))
    assert s(logits, [r]).token_ids == [2]
    r = mkreq(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True))  # EOS is no stop: not masked
    assert s(logits, [r]).token_ids == [2]


def test_penalties():
    s = Sampler(4, seed=0)
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.05]])
    # repetition penalty (HF): token 0 appeared in the prompt -> 2.0/2 = 1.0 < 1.9
    assert s(logits, [mkreq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(0,))]).token_ids == [1]
    # negative logits are multiplied: -1.0 * 2 = -2.0 < -1.05
    l2 = torch.tensor([[-1.0, -1.05, -5.0, -5.0]])
    assert s(l2, [mkreq(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(0,))]).token_ids == [1]
    # frequency penalty counts occurrences in the output; presence penalty only whether it occurred
    r = mkreq(SamplingParams(temperature=0, frequency_penalty=0.06), outputs=(0, 0))
    assert s(logits, [r]).token_ids == [1]
    r = mkreq(SamplingParams(temperature=0, frequency_penalty=0.06), outputs=(0,))
    assert s(logits, [r]).token_ids == [0]
    r = mkreq(SamplingParams(temperature=0, presence_penalty=0.2), outputs=(0,))
    assert s(logits, [r]).token_ids == [1]
    # only the penalised row changes
    both = s(logits.repeat(2, 1), [mkreq(SamplingParams(temperature=0)),
                                  mkreq(SamplingParams(temperature=0, presence_penalty=0.2), outputs=(0,))])
    assert both.token_ids == [0, 1]


def test_seeded_rows_do_not_depend_on_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def run(rows, positions):
        s = Sampler(50, seed=99)
        target = mkreq(params, rid="t")
        others = [mkreq(SamplingParams(temperature=1.0), rid=f"o{i}") for i in range(len(rows) - 1)]
        toks = []
        for _ in range(6):
            reqs = list(others)
            reqs.insert(positions, target)
            batch = torch.stack([logits[i] for i in rows])
            toks.append(s(batch, reqs).token_ids[positions])
        return toks

    alone = run([0], 0)
    assert run([1, 0, 2], 1) == alone
    assert run([3, 4, 2, 1, 0], 4) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321)
    s = Sampler(50)
    r = mkreq(other_seed)
    assert [s(logits[:1], [r]).token_ids[0] for _ in range(6)] != alone


def test_logprobs_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    s = Sampler(4, seed=0)
    out = s(logits, [mkreq(SamplingParams(temperature=0, logprobs=2))])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], 0)
    assert list(lp) == [1, 2]                    # sampled token first, then the top-2 (1 already there)
    assert lp[1] == pytest.approx(float(ref[1])) and lp[2] == pytest.approx(float(ref[2]))
    reqs = [mkreq(SamplingParams(temperature=0, logprobs=0)), mkreq(SamplingParams(temperature=0))]
    out = s(logits.repeat(2, 1), reqs)
    assert list(out.logprobs[0]) == [1] and out.logprobs[1] is None


def test_invalid_params_raise():
    for bad in (dict(top_p=0.0), dict(temperature=-1), dict(max_tokens=0), dict(min_p=2.0), dict(top_k=-3),
                dict(min_tokens=5, max_tokens=2), dict(stop=[""]), dict(presence_penalty=3.0)):
        with pytest.raises(ValueError, match="invalid SamplingParams"):
            SamplingParams(**bad)


def test_top_k_beyond_any_integer_width_keeps_every_token():
    """A top_k of 2**70 (a valid int: larger than the vocabulary) must not overflow the sampler's tensors."""
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7, 0.6]])
    sampler = Sampler(5, seed=0)
    reqs = [mkreq(SamplingParams(temperature=1.0, top_k=2**70, max_tokens=8), eos=())]
    assert {sampler(logits, reqs).token_ids[0] for _ in range(200)} == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("fields", [dict(repetition_penalty=1e-40, temperature=1.0),
                                    dict(temperature=1e-38), dict(frequency_penalty=-2.0, temperature=1e-37)])
def test_overflowing_penalties_and_temperatures_sample_among_the_largest(fields):
    """A logit pushed past float32's range (a tiny repetition penalty divides it, a tiny temperature too) stays
    finite: the softmax has no NaN and the token is one of the largest, never an arbitrary one."""
    logits = torch.tensor([[0.5, -1.0, 3.0, 2.0, 1.0, -0.5]])
    for seed in range(20):
        req = mkreq(SamplingParams(max_tokens=4, seed=seed, **fields), prompt=(2, 3), outputs=(3, 2))
        token = Sampler(6)(logits.clone(), [req]).token_ids[0]
        assert token in (2, 3), (fields, seed, token)
