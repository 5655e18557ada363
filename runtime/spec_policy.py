"""Cost-aware adaptive k: how many tokens each speculating request proposes in the next step.

Speculation pays when the tokens a step emits grow faster than its cost. For a request whose proposals are
each accepted with probability a (given the ones before were), the j-th proposal adds a^j expected tokens, so
k proposals give 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens. A step's cost is measured, not assumed:

- the target's step time as a function of the tokens in the step (``CostCurve``: the median of recent samples per
  size seen, linear in between), which is where batch size enters: a 16-sequence step that adds 4 proposals
  each costs what 80 tokens cost, measured;
- the proposer's round time as a function of the sequences in the round: a draft model runs one round per
  proposed position, the n-gram lookup one round for all.

``SpecPolicy.choose`` takes the proposals with the largest expected gains first (a_i^j over requests i and
positions j) and keeps the count m that maximises expected tokens per second of the step, plain decode (m = 0)
included; so k = 0 when the draft is too slow or the acceptance too low, and speculation pauses by itself when
a larger step costs more than its proposals bring. What keeps the estimates honest:

- the first step seen at a size is a warm-up (first-touch costs), not recorded; a size's estimate is the median
  of its last samples (a step slowed by another process on the cores does not stick), and a size not measured
  for ``EXPIRE`` steps is dropped, so a once-slow size is tried again;
- above the largest size seen the curve is flat when it knows one size (so a larger step gets tried) and
  linear with its mean slope otherwise; below the smallest it scales with the size (so a plain step gets tried);
- a plain decode step is taken when the plain size's estimate is older than ``REFRESH`` steps;
- a request left at k = 0 gets one probe token after ``backoff_steps`` steps (at most one probe per that many
  steps for the whole engine), so its acceptance is re-measured and k grows back when it recovers; no probe
  when even acceptance 1 would not pay at the measured costs (the probe could not change the choice).

What keeps the choice cheap (it runs every step, and on a small model a step is well under a millisecond): an
n-gram lookup runs first and only requests with a proposal are weighed (the executor); the sort is skipped when
all the gains together could not pay; and a "propose nothing" choice is kept for ``REUSE`` steps while the
requests, their caps, the step's size and every acceptance stay the same.

Acceptance per request: exponential averages of accepted proposals A and of rejections R (steps where a
proposal was rejected); a = A / (A + R) is the per-position estimate for truncated geometric outcomes. A new
request starts from the engine-wide average.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

DECAY = 0.7          # per-request acceptance memory (per verify step)
GLOBAL_DECAY = 0.95  # the engine-wide prior's memory
PRIOR_WEIGHT = 2.0   # pseudo-steps of the prior a new request starts with
WINDOW = 5           # samples kept per size: the estimate is their median
REFRESH = 64         # steps after which the plain step's estimate is re-measured
EXPIRE = 512         # steps after which a size's estimate is dropped (it is measured again when next tried)
REUSE = 8            # steps a "propose nothing" choice is kept while the step's make-up and the acceptances hold


class CostCurve:
    """Seconds of a step by its size: the median of its last WINDOW samples per size seen (after a warm-up
    sighting), piecewise linear between sizes (see the module docstring for outside them). ``clock`` counts
    steps (the policy advances it) for ``stale`` and ``expire``."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.seconds: dict[int, float] = {}
        self.clock = 0
        self._samples: dict[int, deque[float]] = {}
        self._updated: dict[int, int] = {}
        self._warm: set[int] = set()

    def observe(self, size: int, seconds: float) -> None:
        if size <= 0:
            return
        samples = self._samples.get(size)
        if samples is None:
            if size not in self._warm:
                self._warm.add(size)
                return
            bisect.insort(self.sizes, size)
            samples = self._samples[size] = deque(maxlen=WINDOW)
        samples.append(seconds)
        self.seconds[size] = sorted(samples)[(len(samples) - 1) // 2]   # the lower median
        self._updated[size] = self.clock

    def stale(self, size: int, horizon: int = REFRESH) -> bool:
        """Not measured at ``size`` within the last ``horizon`` steps."""
        return size not in self._updated or self.clock - self._updated[size] > horizon

    def expire(self) -> None:
        """Drop the sizes not measured for EXPIRE steps (a slow sample there must not keep a size untried)."""
        old = [n for n in self.sizes if self.stale(n, EXPIRE)]
        for n in old:
            self.sizes.remove(n)
            del self.seconds[n], self._samples[n], self._updated[n]

    def __call__(self, size: int) -> float | None:
        """The estimate at ``size`` (None before any measurement)."""
        s = self.sizes
        if not s:
            return None
        t = self.seconds
        if size <= s[0]:
            return t[s[0]] * size / s[0]
        if size >= s[-1]:
            if len(s) == 1:
                return t[s[-1]]
            slope = max(0.0, (t[s[-1]] - t[s[0]]) / (s[-1] - s[0]))
            return t[s[-1]] + slope * (size - s[-1])
        i = bisect.bisect_left(s, size)
        lo, hi = s[i - 1], s[i]
        if hi == size:
            return t[hi]
        return t[lo] + (t[hi] - t[lo]) * (size - lo) / (hi - lo)


@dataclass
class _Acceptance:
    accepted: float
    rejected: float
    idle: int = 0   # steps since it last proposed

    @property
    def rate(self) -> float:
        total = self.accepted + self.rejected
        return self.accepted / total if total > 0 else 1.0


class SpecPolicy:
    """Per engine: the measured costs, each request's acceptance, and the choice of each request's k."""

    def __init__(self, num_speculative_tokens: int, adaptive: bool, probe_interval: int,
                 round_per_position: bool):
        self.k = num_speculative_tokens
        self.adaptive = adaptive
        self.probe_interval = probe_interval
        self.round_per_position = round_per_position   # a draft model: one round per proposed position
        self.target = CostCurve()   # target step seconds by tokens in the step
        self.draft = CostCurve()    # proposer round seconds by sequences (tokens) in the round
        self._requests: dict[str, _Acceptance] = {}
        self._prior = _Acceptance(1.0, 1.0)
        self._since_probe = 0
        self._records = 0   # verify outcomes recorded: a kept "propose nothing" choice lapses at the next one
        self._plain_memo: tuple | None = None   # (what the choice was made for, the step it lapses at)

    # ---- what happened ----------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A target step's size and seconds (also the clock of both curves); nothing when not adaptive (the
        choice reads no costs then)."""
        if not self.adaptive:
            return
        for curve in (self.target, self.draft):
            curve.clock += 1
            if curve.clock % 64 == 0:
                curve.expire()
        self.target.observe(num_tokens, seconds)

    def observe_round(self, num_seqs: int, seconds: float) -> None:
        self.draft.observe(num_seqs, seconds)

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verify step's outcome for one request."""
        if proposed <= 0:
            return
        rejected = 1.0 if accepted < proposed else 0.0
        self._records += 1
        for a, decay in ((self._request(request_id), DECAY), (self._prior, GLOBAL_DECAY)):
            a.accepted = decay * a.accepted + accepted
            a.rejected = decay * a.rejected + rejected

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def acceptance(self, request_id: str) -> float:
        return self._request(request_id).rate

    def _request(self, request_id: str) -> _Acceptance:
        a = self._requests.get(request_id)
        if a is None:
            p = self._prior.rate
            a = self._requests[request_id] = _Acceptance(PRIOR_WEIGHT * p, PRIOR_WEIGHT * (1 - p))
        return a

    # ---- the choice -------------------------------------------------------------------------------
    def choose(self, candidates: list[tuple[str, int, bool]], base_tokens: int, num_decoding: int,
               max_total: int) -> list[int]:
        """k for each (request id, most it may propose, fixed) in ``candidates``, for a step whose plain form has
        ``base_tokens`` tokens of which ``num_decoding`` are decode tokens; at most ``max_total`` in all. A fixed
        request always gets its most (a seeded request sampled through a draft model: its tokens depend on its
        k sequence, which must not depend on timings)."""
        caps = [min(c, self.k) for _, c, _ in candidates]
        if not self.adaptive or self.target(base_tokens) is None:   # nothing measured yet: full k, to measure
            return _fill(caps, max_total)
        ks = [0] * len(caps)
        tokens = float(num_decoding)
        for i, (rid, _, fixed) in enumerate(candidates):
            if fixed:
                ks[i] = min(caps[i], max_total)
                max_total -= ks[i]
                base_tokens += ks[i]
                tokens += sum(self._request(rid).rate ** j for j in range(1, ks[i] + 1))
        self._since_probe += 1
        if num_decoding == base_tokens and self.target.stale(base_tokens):
            return ks   # a plain step, to re-measure what speculation is compared with
        accs = [self._request(rid) for rid, _, _ in candidates]
        base_time = self.target(base_tokens)
        best_rate, best_m = tokens / base_time, 0
        draft_time, worse = 0.0, 0
        rounds: list[int] = []   # sequences in each proposer round (the fixed requests' rounds are not counted:
        # they run whatever this choice is). No m can beat plain decode when all the gains together (each
        # request's a + ... + a^cap), at the cost of a plain step plus one proposer round, do not: then the sort
        # is skipped (low acceptance, the common case for text that does not repeat, costs a few microseconds)
        # A "propose nothing" choice is kept for REUSE steps while the requests, their caps, the step's size and
        # every acceptance stay as they were (only the costs' noise moves then): re-deciding it every step cost
        # ~30 us of a 0.6 ms step on the small model, speculation's whole loss on text that does not repeat.
        key = (tuple(rid for rid, _, _ in candidates), tuple(caps), base_tokens, num_decoding, max_total,
               self._records)
        memo = self._plain_memo
        kept = memo is not None and memo[0] == key and self.target.clock < memo[1]
        most = 0.0 if kept else sum(_geometric(a.rate, caps[i]) for i, a in enumerate(accs) if not candidates[i][2])
        gains = [] if kept or (tokens + most) / (base_time + (self.draft(1) or 0.0)) <= best_rate else sorted(
            ((a.rate ** j, j, i) for i, a in enumerate(accs) if not candidates[i][2] for j in range(1, caps[i] + 1)),
            key=lambda g: (-g[0], g[1]))
        for m, (gain, j, _) in enumerate(gains[:max_total], 1):
            tokens += gain
            r = j - 1 if self.round_per_position else 0
            if r == len(rounds):
                rounds.append(0)
            before = (self.draft(rounds[r]) or 0.0) if rounds[r] else 0.0
            rounds[r] += 1
            draft_time += (self.draft(rounds[r]) or 0.0) - before
            rate = tokens / (max(self.target(base_tokens + m), base_time) + draft_time)
            if rate > best_rate:
                best_rate, best_m, worse = rate, m, 0
            else:
                worse += 1
                if worse >= 4:   # gains only shrink from here and costs grow
                    break
        for _, _, i in gains[:best_m]:
            ks[i] += 1
        if best_m == 0 and not kept:
            self._plain_memo = (key, self.target.clock + REUSE)
        for i, a in enumerate(accs):
            a.idle = 0 if ks[i] else a.idle + 1
        if self._since_probe > self.probe_interval and sum(ks) < max_total:
            idle = max(range(len(ks)), key=lambda i: accs[i].idle if caps[i] else -1, default=None)
            if (idle is not None and ks[idle] == 0 and caps[idle] and accs[idle].idle > self.probe_interval
                    and self._could_pay(caps[idle], base_tokens, num_decoding, base_time)):
                ks[idle], accs[idle].idle, self._since_probe = 1, 0, 0
        return ks

    def _could_pay(self, cap: int, base_tokens: int, num_decoding: int, base_time: float) -> bool:
        """Whether some k <= cap would beat plain decode for one request at acceptance 1 (else a probe of its
        acceptance cannot change the choice: the costs alone rule speculation out)."""
        plain = num_decoding / base_time
        d1 = self.draft(1) or 0.0
        for j in range(1, cap + 1):
            draft_time = d1 * (j if self.round_per_position else 1)
            if (num_decoding + j) / (max(self.target(base_tokens + j), base_time) + draft_time) > plain:
                return True
        return False


def _geometric(a: float, n: int) -> float:
    """a + a^2 + ... + a^n: the expected tokens of n proposals accepted with probability a each."""
    return n if a >= 1.0 else a * (1.0 - a ** n) / (1.0 - a)


def _fill(caps: list[int], max_total: int) -> list[int]:
    """Each its cap, in order, within ``max_total``."""
    out = []
    for c in caps:
        take = min(c, max_total)
        out.append(take)
        max_total -= take
    return out
