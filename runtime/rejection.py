"""Rejection sampling of a draft model's proposals (Leviathan et al. 2023, Chen et al. 2023).

Proposal d_j was drawn from the draft's distribution q_j; the target's at the same position is p_j (both after
the request's sampling transforms, the proposals before j counted as generated). d_j is accepted with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from the residual
normalize(max(0, p_j - q_j)) and the rest is dropped; when every proposal is accepted, a bonus token is drawn
from p_k. Each emitted token is then distributed exactly as the target's, whatever q is. The draws come from
the request's generator (its own when seeded), so a seeded request repeats itself.

Greedy requests never get here: for them the verifier accepts the longest prefix equal to the target's argmax
(``Executor._verify``), which is this rule with point masses.
"""

from __future__ import annotations

import torch

from kiln.runtime.sampler import Sampler


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int],
                     generator: torch.Generator) -> tuple[int, int]:
    """p [k + 1, V] target, q [k, V] draft, ``drafts`` the k proposals -> (proposals accepted, the token after
    them)."""
    k = len(drafts)
    d = torch.tensor(drafts, dtype=torch.int64)
    rows = torch.arange(k)
    u = torch.rand(k, generator=generator, dtype=torch.float64)
    ok = (u * q[rows, d].double() < p[rows, d].double()).tolist()   # u < p/q, without dividing by q
    a = ok.index(False) if False in ok else k
    if a < k:
        dist = (p[a] - q[a]).clamp(min=0)
        if not float(dist.sum()) > 0:   # p == q up to rounding: nothing is left to correct
            dist = p[a]
    else:
        dist = p[k]
    return a, int(torch.multinomial(dist, 1, generator=generator)[0])


def verify_drafted(sampler: Sampler, logits: torch.Tensor, views: list, drafts: list[int],
                   q: torch.Tensor) -> tuple[int, int, list]:
    """One sampled request's verify rows (``views``: its positions, see ``speculative.Position``) -> (accepted,
    the token after them, the logprobs of the emitted tokens)."""
    processed, p = sampler.distribution(logits, views)
    a, token = rejection_sample(p, q, drafts, sampler.generator_of(views[0]))
    emitted = drafts[:a] + [token]
    return a, token, Sampler.logprobs(processed[:a + 1], views[:a + 1], emitted)
