"""``kiln plan --speculative-config``: what speculation costs in memory and what it buys a decoding sequence.

Memory (exact, as the runtime sizes it): a draft model's weights come out of the memory left after the target's,
and the KV budget is shared by both pools, split by KV bytes per token so that both hold the same tokens
(``Executor.__init__``; the draft pool's blocks from ``kiln.runtime.draft_model.draft_pool_blocks``). The ngram
method costs no memory.

Speed (a model, not a measurement): one verify step of a sequence computes 1 + k tokens (its last token and k
proposals) and their logits rows; a draft-model round adds k single-token steps of the draft. A step yields
``tokens_per_step`` = 1 + the expected accepted proposals: from a measured run (a ``kiln bench`` result of a
speculating server: (accepted + verify steps) / verify steps), or from a per-position acceptance rate ``a``
taken as independent from position to position: 1 + a + a^2 + ... + a^k. The time per output token is the
verify step plus the draft round over ``tokens_per_step``, against a plain decode step; the draft's catch-up on
the verified tokens and the proposer's host work are left out (they make the real speed-up smaller).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kiln.bench.engine_facts import EngineFacts
from kiln.bench.planner import PlanError, _v
from kiln.bench.report import ResultError, read_result


@dataclass(frozen=True)
class SpeculationInputs:
    """What ``plan`` needs of a speculative_config: the method, k, the draft's facts (draft_model) and the
    acceptance (None: the section gives the break-even point only)."""

    method: str
    num_speculative_tokens: int
    acceptance: Acceptance | None = None
    draft: EngineFacts | None = None


@dataclass(frozen=True)
class Acceptance:
    """Expected tokens a verify step yields, or the per-position rate they follow from, and where it came from."""

    rate: float | None            # per-position acceptance rate (independent positions), or None when measured
    tokens_per_step: float | None  # measured (accepted + verify steps) / verify steps, or None when from ``rate``
    source: str

    def expected_tokens(self, k: int) -> float:
        if self.tokens_per_step is not None:
            return self.tokens_per_step
        a = self.rate
        return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def parse_acceptance(value: str) -> Acceptance:
    """``--spec-acceptance``: a rate in [0, 1], or a kiln bench result.json of a speculating server."""
    try:
        rate = float(value)
    except ValueError:
        rate = None
    if rate is not None:
        if not 0 <= rate <= 1:
            raise PlanError(f"--spec-acceptance must be a rate in [0, 1] or a kiln bench result.json, got {value}")
        return Acceptance(rate, None, f"--spec-acceptance {rate:g} per position (independent positions)")
    try:
        result = read_result(value)
    except ResultError as exc:
        raise PlanError(f"--spec-acceptance: {exc}") from None
    steps = accepted = 0.0
    for run in result["runs"]:
        server = run.get("server") or {}
        steps += server.get("spec_verify_steps") or 0
        accepted += server.get("spec_accepted_tokens") or 0
    if not steps:
        raise PlanError(f"--spec-acceptance {value}: the result has no verify steps (run kiln bench against a "
                            "server started with --speculative-config)")
    return Acceptance(None, (accepted + steps) / steps,
                      f"measured in {value}: {accepted:.0f} proposals accepted over {steps:.0f} verify steps")


def draft_memory(mem: dict, draft, draft_blocks: int) -> None:
    """The draft's share of the plan's memory section (its weights and its pool)."""
    block = draft.bounds.tokens_per_block
    mem["draft_weights"] = _v(draft.weights_bytes, f"the draft engine {draft.name} (weights as stored)", "B")
    mem["draft_kv_bytes_per_token"] = _v(draft.kv_bytes_per_token, f"the draft engine {draft.name}", "B")
    mem["draft_kv_pool_blocks"] = _v(draft_blocks, "kiln.runtime.draft_model.draft_pool_blocks: the target pool's "
                                                       "tokens, in the draft's blocks", "blocks")
    mem["draft_kv_pool_bytes"] = _v(draft_blocks * block * draft.kv_bytes_per_token,
                                     f"blocks x {block} tokens x the draft's KV bytes per token", "B")


def plan_speculation(k: int, method: str, acceptance: Acceptance | None, step_s: Callable[[int], float],
                     draft_step_s: float | None) -> dict:
    """The ``speculative`` section: a sequence's time per output token with and without speculation.

    ``step_s(n)``: the target's step of one sequence computing n tokens with n logits rows (batch 1);
    ``draft_step_s``: one single-token step of the draft (None for ngram).
    """
    out: dict = {"method": _v(method, "--speculative-config"), "num_speculative_tokens": _v(k, "--speculative-config")}
    plain, verify = step_s(1), step_s(1 + k)
    draft_round = k * draft_step_s if draft_step_s is not None else 0.0
    out["plain_step"] = _v(plain, "the step-time model at batch 1 (step_time above)", "s")
    out["verify_step"] = _v(verify, f"the same step computing 1 + {k} tokens with their {1 + k} logits rows", "s")
    if draft_step_s is not None:
        out["draft_round"] = _v(draft_round, f"{k} single-token steps of the draft, {draft_step_s * 1e3:.2f} ms each "
                                            "(its streamed weights / bandwidth + its FLOPs; catch-up left out)", "s")
    cost = (verify + draft_round) / plain   # a step's cost in plain steps
    out["break_even_tokens_per_step"] = _v(cost, "(verify step + draft round) / plain step: below it speculation "
                                                "loses", "tokens")
    a = _rate_for(k, cost)
    out["break_even_acceptance"] = _v(a, f"the per-position rate a with 1 + a + ... + a^{k} = {cost:.2f}"
                                     if a is not None else "not reachable: a step with every proposal accepted "
                                     "does not pay for itself")
    if acceptance is None:
        out["note"] = _v("give --spec-acceptance RATE|RESULT.json for the expected speed-up", "")
        return out
    e = acceptance.expected_tokens(k)
    out["tokens_per_step"] = _v(e, acceptance.source, "tokens")
    out["time_per_output_token"] = _v((verify + draft_round) / e, "(verify step + draft round) / tokens per step", "s")
    out["speedup_batch_1"] = _v(e / cost, "plain step / time per output token", "x")
    return out


def _rate_for(k: int, tokens: float) -> float | None:
    """The per-position acceptance rate whose expected tokens per step is ``tokens`` (None above k + 1)."""
    if tokens <= 1:
        return 0.0
    if tokens > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if Acceptance(mid, None, "").expected_tokens(k) < tokens else (lo, mid)
    return math.floor(hi * 1000) / 1000
