"""Speculative decoding: the configuration, the n-gram proposer and the per-request adaptive k.

A speculating request is scheduled with 1 + k tokens (its last token and k proposed ones) in the same packed
step as everyone else; the engine returns logits for all of them; the verifier (``Executor._verify``) samples
the target at each position and accepts proposals while they equal the target's token, then the target's own
token at the first mismatch (or after the last proposal). Each proposal here is a single token (a point-mass
draft), and for such drafts sampling the target and comparing *is* rejection sampling (Leviathan et al.): the
proposal d is accepted with probability p(d), and a token drawn from p that is not d is distributed as the
residual (p - q)+ normalised. So greedy requests get exactly the target's argmax chain and sampled ones exactly
the target's distribution, with penalties, truncation and min_tokens applied position by position.

The n-gram proposer (prompt lookup) proposes the continuation of the most recent earlier occurrence of the
longest suffix of ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens. Its index is built incrementally per
request (each new token adds one entry per n-gram size), so a proposal costs a few dict lookups, not a scan.

Adaptive k (per request): after each verify step the request's acceptance (an exponential average of accepted /
proposed) sets its next k; below ``min_acceptance`` it stops proposing for ``backoff_steps`` steps, then tries
one token again. Speculation pauses for the whole step when more than ``disable_by_batch_size`` sequences run
(decode is compute-bound there: a 1 + k-token step costs nearly 1 + k times a 1-token step).

Draft-model proposals (``kiln.runtime.draft_model``) are not point masses: a sampled request's are verified by
rejection sampling with the draft's distribution (``kiln.runtime.rejection``); a greedy request's as above.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from kiln.contract import ConfigError, reject_unknown_options
from kiln.runtime.fields import FieldChecks

METHODS = ("ngram", "draft_model")


@reject_unknown_options()
@dataclass
class SpeculativeConfig:
    """``speculative_config`` (vLLM's keys, plus the adaptive policy's)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    adaptive: bool = True
    min_acceptance: float = 0.3
    backoff_steps: int = 16
    disable_by_batch_size: int = 3   # docs/benchmarks.md: the ngram crossover is between batch 3 and 4

    def __post_init__(self) -> None:
        c = FieldChecks()
        c.choice("method", self.method, METHODS)
        self.num_speculative_tokens = c.integer("num_speculative_tokens", self.num_speculative_tokens, 1, 16)
        self.prompt_lookup_max = c.integer("prompt_lookup_max", self.prompt_lookup_max, 1)
        self.prompt_lookup_min = c.integer("prompt_lookup_min", self.prompt_lookup_min, 1)
        self.adaptive = c.flag("adaptive", self.adaptive)
        self.min_acceptance = c.number("min_acceptance", self.min_acceptance, 0, 1)
        self.backoff_steps = c.integer("backoff_steps", self.backoff_steps, 1)
        self.disable_by_batch_size = c.integer("disable_by_batch_size", self.disable_by_batch_size, 1)
        if (isinstance(self.prompt_lookup_min, int) and isinstance(self.prompt_lookup_max, int)
                and self.prompt_lookup_min > self.prompt_lookup_max):
            c.problems.append(f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                              f"({self.prompt_lookup_max})")
        if self.method == "draft_model":
            if not (isinstance(self.model, str) and self.model):
                c.problems.append(f"method 'draft_model' needs model, the draft's kiln engine directory, got "
                                  f"{self.model!r:.60}")
        elif self.model is not None:
            c.problems.append("model is a draft_model option; method 'ngram' takes none")
        if c.problems:
            raise ConfigError("invalid speculative_config: " + "; ".join(c.problems))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, value: Any) -> SpeculativeConfig | None:
        """From itself, a dict of its keys, a JSON object string (the command line's form), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON ({exc}); give an object such as "
                                  '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a SpeculativeConfig, a dict, a JSON object string or "
                              f"None, got {type(value).__name__}")
        return cls(**value)


@dataclass
class _NgramIndex:
    """One request's n-gram -> end position of its latest occurrence, for each n-gram size."""

    maps: list[dict[tuple[int, ...], int]]
    indexed: int = 0          # ends 1..indexed are in the maps


@dataclass
class _Adaptive:
    acceptance: float = 1.0   # exponential average of accepted / proposed
    k: int = 0
    pause: int = 0            # steps left without proposals


class Proposer:
    """What the executor sees of a proposer: each request's adaptive k, its proposals for the next step
    (``propose_all`` sets ``spec_token_ids``), the outcome of each verify step, and its end. A point-mass
    proposer (n-gram) has no draft distribution; a draft model's (``kiln.runtime.draft_model``) holds KV that
    rolls back and is freed with its target's."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._adaptive: dict[str, _Adaptive] = {}

    def forget(self, request_id: str) -> None:
        self._adaptive.pop(request_id, None)

    def num_tokens(self, request_id: str) -> int:
        """How many tokens the request may propose next (adaptive k; 0 while paused)."""
        a = self._adaptive.get(request_id)
        if a is None:
            a = self._adaptive[request_id] = _Adaptive(k=self.config.num_speculative_tokens)
        if a.pause > 0:
            a.pause -= 1
            return 0
        return a.k

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verify step's outcome: adapt the request's k (see the module docstring)."""
        c = self.config
        a = self._adaptive.get(request_id)
        if a is None or not c.adaptive or proposed == 0:
            return
        a.acceptance = 0.7 * a.acceptance + 0.3 * accepted / proposed
        if a.acceptance < c.min_acceptance:
            a.pause, a.k, a.acceptance = c.backoff_steps, 1, c.min_acceptance   # retry with 1 token after the pause
        elif accepted == proposed:
            a.k = min(c.num_speculative_tokens, a.k + 1)
        else:
            a.k = max(1, min(a.k, accepted + 1))

    def propose_all(self, wants: list[tuple[Any, int]]) -> None:
        """Set ``spec_token_ids`` (at most k tokens) of each (request, k) in ``wants``."""
        raise NotImplementedError

    def draft_probs(self, request_id: str):
        """The draft's distribution of each proposal (a [k, vocab] tensor), or None for point-mass proposals."""
        return None

    def rolled_back(self, requests: list) -> None:
        """Their verify step accepted a prefix of their proposals (the proposer's own state follows)."""

    def release(self, requests: list) -> None:
        """They were preempted (whatever the proposer holds for them goes back)."""

    def close(self) -> None:
        """The executor stopped (a draft engine is closed)."""


class NgramProposer(Proposer):
    """Prompt-lookup proposals, with each request's incremental index and adaptive k."""

    def __init__(self, config: SpeculativeConfig):
        super().__init__(config)
        self.sizes = list(range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1))
        self._index: dict[str, _NgramIndex] = {}

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)
        super().forget(request_id)

    def propose_all(self, wants: list[tuple[Any, int]]) -> None:
        for req, k in wants:
            req.spec_token_ids = self.propose(req.request_id, req.all_token_ids, k)

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        idx = self._index.get(request_id)
        if idx is None:
            idx = self._index[request_id] = _NgramIndex([{} for _ in self.sizes])
        length = len(tokens)
        for end in range(idx.indexed + 1, length):   # ends before the current suffix's
            for n, m in zip(self.sizes, idx.maps):
                if end >= n:
                    m[tuple(tokens[end - n:end])] = end
        idx.indexed = max(idx.indexed, length - 1)
        for n, m in zip(self.sizes, idx.maps):
            if length > n:
                end = m.get(tuple(tokens[length - n:]))
                if end is not None:   # past the current end, a loop of period length - end repeats
                    period = length - end
                    return [tokens[end + i % period] for i in range(k)]
        return []


class Position:
    """A speculating request as the sampler sees it at one verified position: the proposals before it count as
    generated (penalties, min_tokens), and it draws from the request's own generator (seeded reproducibility)."""

    __slots__ = ("request", "num_drafts")
    grammar = None   # structured-output requests do not speculate

    def __init__(self, request, num_drafts: int):
        self.request = request
        self.num_drafts = num_drafts

    @property
    def params(self):
        return self.request.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.request.eos_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.request.spec_token_ids[:self.num_drafts]

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + self.num_drafts

    @property
    def generator(self):
        return self.request.generator

    @generator.setter
    def generator(self, value) -> None:
        self.request.generator = value
