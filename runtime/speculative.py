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

Adaptive k (per request): ``kiln.runtime.spec_policy`` picks each request's k from the measured cost of a
target step by its size, the proposer's round cost and the request's recent acceptance (k = 0 when no k beats
plain decode, so speculation also pauses by itself at batch sizes where a larger step costs more than its
proposals bring); ``disable_by_batch_size`` is a hard cap on top (vLLM's key).

Draft-model proposals (``kiln.runtime.draft_model``) are not point masses: a sampled request's are verified by
rejection sampling with the draft's distribution (``kiln.runtime.rejection``); a greedy request's as above.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from kiln.contract import ConfigError, reject_unknown_options
from kiln.runtime.fields import FieldChecks
from kiln.runtime.spec_policy import SpecPolicy

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
    backoff_steps: int = 16                  # a request left at k = 0 is probed with one token after this many
    disable_by_batch_size: int | None = None  # no proposals while more sequences run (a hard cap on the policy)

    def __post_init__(self) -> None:
        c = FieldChecks()
        c.choice("method", self.method, METHODS)
        self.num_speculative_tokens = c.integer("num_speculative_tokens", self.num_speculative_tokens, 1, 16)
        self.prompt_lookup_max = c.integer("prompt_lookup_max", self.prompt_lookup_max, 1)
        self.prompt_lookup_min = c.integer("prompt_lookup_min", self.prompt_lookup_min, 1)
        self.adaptive = c.flag("adaptive", self.adaptive)
        self.backoff_steps = c.integer("backoff_steps", self.backoff_steps, 1)
        self.disable_by_batch_size = c.integer("disable_by_batch_size", self.disable_by_batch_size, 1,
                                               optional=True)
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


class Proposer:
    """What the executor sees of a proposer: its policy (``kiln.runtime.spec_policy``: each request's k from
    measured costs and acceptance), its proposals for the next step (``propose_all`` sets ``spec_token_ids``),
    the outcome of each verify step, and its end. A point-mass proposer (n-gram) has no draft distribution; a
    draft model's (``kiln.runtime.draft_model``) holds KV that rolls back and is freed with its target's."""

    round_per_position = False   # a draft model runs one round per proposed position, the n-gram lookup one

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.policy = SpecPolicy(config.num_speculative_tokens, config.adaptive, config.backoff_steps,
                                 self.round_per_position)

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verify step's outcome (the policy's acceptance estimate follows)."""
        self.policy.record(request_id, proposed, accepted)

    def fixed_k(self, request) -> bool:
        """Whether the request's tokens depend on its k sequence (then k must not follow timings)."""
        return False

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
        t0 = time.perf_counter()
        for req, k in wants:
            req.spec_token_ids = self.propose(req.request_id, req.all_token_ids, k)
        self.policy.observe_round(len(wants), time.perf_counter() - t0)

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
