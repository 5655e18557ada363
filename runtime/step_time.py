"""This engine's step time ``a + b x tokens``, fitted from the steps it runs, and the scheduling knobs it sets.

``a`` is what every step pays whatever its size (reading the weights, launching the graph), ``b`` the cost of
one more token (its FLOPs). ``kiln bench`` fits the same line from the same step records, and ``kiln plan``
turns it into recommendations; the executor refits it as it serves and hands it to the scheduler, whose decode
pace (``tpot_target_s``) turns a stream's banked time into prefill tokens with it. It also sets the queue's lead,
and given ``schedule_from_step_time`` the decoding budget (an option the user gave explicitly is left alone):

* ``decoding_max_num_tokens`` (``schedule_from_step_time`` only) = the smallest block-aligned budget whose fixed
  cost is at most ``AMORTIZED_SHARE`` of the step (``N >= 9 a / b``): steps that carry decodes stay as short as
  they can while the prefill beside them still runs at >= 90% of the machine's rate. It is at least a full batch of
  decodes plus a block, and none when that is the whole budget already.
* ``short_prompt_lead_s`` (by default) = ``b x max_input_len``, the prefill time of the longest prompt: a long
  prompt yields to shorter ones for at most as long as its own prefill takes.
"""

from __future__ import annotations

import logging
import math
from collections import deque

import numpy as np

from kiln.runtime.scheduler import least_decoding_budget

logger = logging.getLogger("kiln.runtime")
AMORTIZED_SHARE = 0.10   # the most share of a step its fixed cost may take, for the budget chosen from the fit


def fit_step_time(rows: list[tuple[float, float, float]]) -> dict | None:
    """Least-squares fit of engine time = a x steps + b x tokens over (steps, tokens, seconds) rows.

    a is the fixed cost of a step (reading the weights, launching the graph), b the cost of one token
    (its FLOPs); a per-step record is the row (1, tokens, seconds). None if the rows cannot tell a from b.
    """
    if len(rows) < 2:
        return None
    x = np.array([[s, t] for s, t, _ in rows], dtype=float)
    y = np.array([sec for _, _, sec in rows], dtype=float)
    if np.linalg.matrix_rank(x) < 2:
        return None
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ np.array([a, b])
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return {"step_fixed_s": float(a), "per_token_s": float(b), "rows": len(rows), "r2": r2}


def amortized_budget(step_fixed_s: float, per_token_s: float) -> int:
    """The fewest tokens a step needs for its fixed cost to be at most AMORTIZED_SHARE of it."""
    return math.ceil((1 - AMORTIZED_SHARE) / AMORTIZED_SHARE * step_fixed_s / per_token_s)


class StepTimeKnobs:
    """Refits ``a + b x tokens`` over the last ``window`` steps and sets the scheduler's knobs from it (see the
    module docstring): every ``every`` steps while it has fewer than ``every_fitted`` steps, then every
    ``every_fitted`` (a refit reads the whole window, too much work for every few steps of the loop). The first fits
    come early because the decode pace has none to go by before them: without them a server's first burst runs
    unpaced, and its full-budget steps set the TPOT p95 of a sweep's first rate.
    ``config`` is the SchedulerConfig the scheduler reads each step: every fit is its ``step_time``, and sets the
    two knobs but those ``fixed`` names (the user set them; the executor sets the decoding budget only given
    ``schedule_from_step_time``)."""

    MIN_ROWS = 4         # steps before the first fit (a server's first burst should not wait long for it)
    MIN_SPREAD = 4.0     # the largest step must hold this many times the tokens of the smallest, or a, b are noise

    def __init__(self, config, block: int, fixed: frozenset[str] = frozenset(), window: int = 512,
                 every: int = 4, every_fitted: int = 64):
        self.config = config
        self.block = block
        self.fixed = fixed
        self.every = every
        self.every_fitted = every_fitted
        self.rows: deque[tuple[int, float]] = deque(maxlen=window)
        self.fit: dict | None = None
        self.fits = 0        # refits so far (the first is logged at INFO, the rest at DEBUG)
        self._since = 0
        self._largest = 0    # tokens of the largest step before the first fit

    def observe(self, tokens: int, seconds: float) -> None:
        """One step's tokens and engine time; refits every ``every`` steps (``every_fitted`` once fitted on as
        many steps)."""
        if tokens <= 0:
            return
        self.rows.append((tokens, seconds))
        self._since += 1
        if self.fit is None and tokens >= self._largest:
            # until the steps tell a from b, the largest step's time per token as if a step had no fixed cost: a
            # step of fewer tokens takes longer than it says (a is spread over fewer), but not by much once the
            # pace's steps are a few hundred tokens, and a first burst of full prompts is not unpaced
            self._largest = tokens
            self.config.step_time = (0.0, seconds / tokens)
        early = self.fit is None or len(self.rows) < self.every_fitted
        if self._since >= (self.every if early else self.every_fitted) and len(self.rows) >= self.MIN_ROWS:
            self._since = 0
            self._refit()

    def _refit(self) -> None:
        sizes = [t for t, _ in self.rows]
        if max(sizes) < self.MIN_SPREAD * min(sizes) or max(sizes) - min(sizes) < 2 * self.block:
            return   # all steps alike: the fixed cost cannot be told from the per-token one
        fit = fit_step_time([(1.0, t, s) for t, s in self.rows])
        if fit is None or fit["step_fixed_s"] <= 0 or fit["per_token_s"] <= 0:
            return
        self.fit = fit
        c = self.config
        c.step_time = (fit["step_fixed_s"], fit["per_token_s"])
        if "decoding_max_num_tokens" not in self.fixed:
            want = -(-amortized_budget(fit["step_fixed_s"], fit["per_token_s"]) // self.block) * self.block
            n = max(want, least_decoding_budget(c.max_batch_size, self.block))
            c.decoding_max_num_tokens = n if n < c.max_num_tokens else None
        if "short_prompt_lead_s" not in self.fixed:
            c.short_prompt_lead_s = fit["per_token_s"] * c.max_input_len
        first, self.fits = self.fits == 0, self.fits + 1
        (logger.info if first else logger.debug)(
            "step time %.1f ms + %.3f ms/token (%d steps, R^2 %.2f): decoding_max_num_tokens %s, short_prompt_lead_s "
            "%.2f", fit["step_fixed_s"] * 1e3, fit["per_token_s"] * 1e3, fit["rows"], fit["r2"],
            c.decoding_max_num_tokens, c.short_prompt_lead_s)

    def as_dict(self) -> dict | None:
        """The fit now (None before the first), for stats()."""
        return None if self.fit is None else dict(self.fit)
