"""The per-step token budget (``max_num_tokens``) and the prefill chunk it leaves, from the engine's step time.

A step costs ``t(n) = a + b n`` (``a``: reading the weights once, ``b``: the compute of one token; the planner's
roofline or the fit ``kiln bench`` measures). The budget trades three things:

* a step whose budget a prefill chunk fills delays every decode in it: ``a + b N`` is the longest step a decoding
  request sees, so with a TPOT target ``N <= (TPOT - a) / b`` keeps even that step within it. That bound is
  ``decoding_max_num_tokens``, the budget of steps that carry decodes; a step with none keeps the full budget;
* a prompt of ``P`` tokens takes ``ceil(P / C)`` steps with chunks of ``C = N - decodes`` tokens, each paying ``a``
  besides its ``b C``: with a TTFT target the chunks of the p95 prompt must fit it, ``P b + ceil(P / C) (a + b D) <=
  TTFT`` (``D`` decodes ride along in each chunk's step);
* a step's fixed cost should stay a small share of a full step (``a <= 10% of a + b N``, ``N >= 9 a / b``) so that
  prefill runs near the machine's FLOP rate.

``max_num_tokens`` is the larger of the last two bounds, block-aligned, at least one block plus one token per
decoding sequence and at most the engine's bound; ``decoding_max_num_tokens`` is the TPOT bound where it is
smaller (block-aligned, at least ``max_batch_size - 1`` plus a block, what the executor accepts).

The decode pace: with a TPOT target, ``tpot_target_s`` = half that target. The pace holds each stream's mean time
a token to it (the executor's own fit converts it into a step budget that follows the load, where
``decoding_max_num_tokens`` is fixed); the p95 of the streams lands near the pace itself past capacity
(docs/benchmarks.md, the Azure code trace under the serving defaults), so half the target keeps it with room.

The queue order: with a TTFT target, ``short_prompt_lead_s`` = half that target, so a prompt of the engine's longest
input lets shorter ones that arrive within half a TTFT target after it go first (the short ones then meet the target
instead of queueing behind long prefills). Half, not the whole: the p95 TTFT is a long prompt's, and on the Azure
code trace (docs/benchmarks.md) a lead of the whole target raised it by up to 1.3x vLLM's, half of it kept it
near first-come-first-served's for about the same goodput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.runtime.scheduler import least_decoding_budget
from kiln.runtime.step_time import AMORTIZED_SHARE, amortized_budget


@dataclass(frozen=True)
class TokenBudget:
    """The recommendation and why: ``max_num_tokens``, the prefill chunk it leaves beside ``decodes`` decodes,
    the bounds it was chosen between (tokens; None where that bound does not apply) and a sentence of reasons."""

    max_num_tokens: int
    prefill_chunk: int
    amortized_min: int
    ttft_min: int | None
    tpot_max: int | None
    reason: str
    decoding_max_num_tokens: int | None = None
    short_prompt_lead_s: float | None = None
    tpot_target_s: float | None = None


def recommend_token_budget(step_fixed_s: float, per_token_s: float, *, block: int, engine_max: int, decodes: int,
                           prompt_p95: float, slo_ttft_s: float | None = None,
                           slo_tpot_s: float | None = None, max_batch_size: int | None = None) -> TokenBudget:
    """The per-step token budget for a step time ``a + b n`` (see the module docstring)."""
    if step_fixed_s <= 0 or per_token_s <= 0:
        raise ValueError(f"the step-time fit needs a > 0 and b > 0 (got a={step_fixed_s}, b={per_token_s}); measure "
                         "it with kiln bench (its calibration) or give the device's bandwidth and FLOP/s")
    a, b = step_fixed_s, per_token_s
    decodes = max(0, int(decodes))
    floor = min(engine_max, cdiv_block(block + decodes, block))
    amortized = amortized_budget(a, b)
    reasons = [f"a step's fixed cost {a * 1e3:.1f} ms is <= {AMORTIZED_SHARE:.0%} of a full step from {amortized} "
               f"tokens (b = {b * 1e3:.3f} ms/token)"]
    ttft_min = None
    if slo_ttft_s is not None and prompt_p95 > 0:
        left = slo_ttft_s - prompt_p95 * b
        if left <= 0:
            reasons.append(f"the p95 prompt ({prompt_p95:.0f} tokens) alone computes for {prompt_p95 * b:.2f} s, past "
                           f"the TTFT target {slo_ttft_s:g} s at any budget")
        else:
            chunks = max(1, math.floor(left / (a + b * decodes)))
            ttft_min = math.ceil(prompt_p95 / chunks) + decodes
            reasons.append(f"the p95 prompt meets TTFT {slo_ttft_s:g} s in <= {chunks} chunks: >= {ttft_min} tokens")
    tpot_max = None
    if slo_tpot_s is not None:
        tpot_max = max(0, math.floor((slo_tpot_s - a) / b))
        reasons.append(f"a full step stays within TPOT {slo_tpot_s * 1e3:.0f} ms up to {tpot_max} tokens")
    want = cdiv_block(max(amortized, ttft_min or 0), block)   # the lower bounds, rounded up to a block
    n = min(engine_max, max(floor, want))
    if n == engine_max and want > engine_max:
        reasons.append(f"capped at the engine's max_num_tokens {engine_max} (rebuild with a larger one to raise it)")
    decoding = None
    if tpot_max is not None and tpot_max < n:
        least = max(floor, least_decoding_budget(max_batch_size or decodes + 1, block))
        decoding = max(least, tpot_max // block * block)
        if decoding < n:
            raised = "" if decoding <= tpot_max else f", raised to the {least} a full batch of decodes needs"
            reasons.append(f"steps that carry decodes take at most {decoding} tokens (decoding_max_num_tokens: the "
                           f"TPOT bound{raised}); steps with none take {n}")
        else:
            reasons.append(f"a full batch of decodes needs {least} tokens beside a block of prefill, not below "
                           f"{n}: steps with decodes keep max_num_tokens")
            decoding = None
    return TokenBudget(n, max(0, (decoding or n) - decodes), amortized, ttft_min, tpot_max, "; ".join(reasons),
                       decoding, None if slo_ttft_s is None else slo_ttft_s / 2,
                       None if slo_tpot_s is None else slo_tpot_s / 2)


def cdiv_block(n: int, block: int) -> int:
    """``n`` rounded up to a multiple of ``block``."""
    return -(-n // block) * block
