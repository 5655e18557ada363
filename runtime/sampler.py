"""Sampler: next tokens for a batch of requests, vectorised over the batch (see sampling_params for the order).

Random draws use the exponential-race form of categorical sampling: ``argmax(p / E)`` with ``E ~ Exp(1)``
per vocabulary entry draws from ``p``. A request with a seed owns a ``torch.Generator`` that produces its
row of ``E`` (one vocabulary-sized draw per generated token), so its tokens depend only on its seed and its
own logits, never on what else is in the batch or in which row it sits. Unseeded rows share one
generator and one batched draw.

Structured output: after the penalties and ``min_tokens``, the rows of requests with a grammar
(``Request.grammar``) get their token bitmask (``kiln.runtime.grammar``): every token the grammar does not
allow next is at -inf before logprobs, temperature and truncation, so greedy, seeded and unseeded rows all
pick an allowed token, and logprobs are those of the distribution sampled from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kiln.plugins.argmax import argmax_rows
from kiln.runtime.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    mask_time: float | None = None   # seconds spent on grammar bitmasks (None: no constrained row)


class Sampler:
    def __init__(self, vocab_size: int, seed: int | None = None):
        self.vocab_size = vocab_size
        self.masks = None   # kiln.runtime.grammar.GrammarMasks, made at the first constrained row
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    # ---- penalties ------------------------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(reqs) if r.params.needs_penalties]
        if not rows:
            return logits
        V = logits.shape[1]
        sub = logits[rows]
        n = len(rows)

        def padded(lists: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(x) for x in lists))
            return torch.tensor([x + [V] * (width - len(x)) for x in lists], dtype=torch.int64)

        out_ids = padded([reqs[i].output_token_ids for i in rows])
        counts = torch.zeros(n, V + 1).scatter_add_(1, out_ids, torch.ones(out_ids.shape))[:, :V]
        rep = torch.tensor([reqs[i].params.repetition_penalty for i in rows]).unsqueeze(1)
        pres = torch.tensor([reqs[i].params.presence_penalty for i in rows]).unsqueeze(1)
        freq = torch.tensor([reqs[i].params.frequency_penalty for i in rows]).unsqueeze(1)
        if bool((rep != 1.0).any()):
            prompt_ids = padded([reqs[i].prompt_token_ids for i in rows])
            seen = torch.zeros(n, V + 1, dtype=torch.bool).scatter_(1, prompt_ids, True)[:, :V] | (counts > 0)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts - pres * (counts > 0).float()
        # a tiny repetition penalty (or a huge frequency one) overflows float32: an infinite logit would make the
        # softmax NaN (and the sampled token arbitrary, even one a grammar forbids), so the largest finite instead
        big = torch.finfo(sub.dtype).max
        sub = sub.clamp(-big, big)
        logits = logits.clone()
        logits[rows] = sub
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        cloned = False
        for i, r in enumerate(reqs):
            p = r.params
            if r.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
                banned = [t for t in banned if 0 <= t < logits.shape[1]]
                if banned:
                    if not cloned:
                        logits, cloned = logits.clone(), True
                    logits[i, banned] = float("-inf")
        return logits

    # ---- truncation -----------------------------------------------------------------------------------
    @staticmethod
    def truncate(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """Temperature-scaled logits [B, V] -> the same with disallowed tokens at -inf.

        top_k [B] int (0 = off), top_p [B] float (1 = off), min_p [B] float (0 = off).
        """
        V = x.shape[1]
        vals, idx = x.sort(dim=1, descending=True)
        rank = torch.arange(V).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, V).unsqueeze(1)
        vals = vals.masked_fill(rank >= k, float("-inf"))
        use_p = top_p < 1.0
        if bool(use_p.any()):
            probs = vals.softmax(dim=1)
            before = probs.cumsum(dim=1) - probs          # mass of the better tokens
            drop = (before >= top_p.unsqueeze(1)) & use_p.unsqueeze(1)
            drop[:, 0] = False
            vals = vals.masked_fill(drop, float("-inf"))
        use_min = min_p > 0
        if bool(use_min.any()):
            probs = vals.softmax(dim=1)
            drop = (probs < min_p.unsqueeze(1) * probs[:, :1]) & use_min.unsqueeze(1)
            drop[:, 0] = False
            vals = vals.masked_fill(drop, float("-inf"))
        return torch.full_like(x, float("-inf")).scatter_(1, idx, vals)

    @staticmethod
    def argmax_only(req) -> bool:
        """Whether the request's token is the argmax of its raw logits: greedy with nothing that changes them
        (penalties, min_tokens still banning, a grammar) and no logprobs asked (speculative decoding then verifies
        its rows with one argmax, without the sampler). Checked at its next position: a later one has more output
        tokens, so min_tokens bans nothing there either."""
        p = req.params
        return (p.temperature == 0 and p.logprobs is None and req.grammar is None and not p.needs_penalties
                and req.num_output_tokens >= p.min_tokens)

    def replay(self, generator: torch.Generator, state: torch.Tensor, draws: int) -> None:
        """Set a seeded request's ``generator`` to ``state`` advanced by ``draws`` of its per-token draws (speculative
        decoding keeps the draws of the positions it accepted and takes back the rest)."""
        generator.set_state(state)
        for _ in range(draws):
            torch.empty(self.vocab_size).exponential_(generator=generator)

    # ---- the step -------------------------------------------------------------------------------------
    def _processed(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, float | None]:
        """Penalties, min_tokens and grammar masks applied (the logits logprobs are taken from); also the
        seconds the grammar masks took (None: no constrained row)."""
        logits = self._apply_penalties(logits, reqs)
        logits = self._apply_min_tokens(logits, reqs)
        mask_time = None
        if any(r.grammar is not None for r in reqs):
            start = time.perf_counter()
            if self.masks is None:
                from kiln.runtime.grammar import GrammarMasks

                self.masks = GrammarMasks(self.vocab_size)
            logits = self.masks.apply(logits, reqs)
            mask_time = time.perf_counter() - start
        return logits, mask_time

    @classmethod
    def _probs(cls, x: torch.Tensor, rr: list[Request]) -> torch.Tensor:
        """Processed logits of rows with temperature > 0 -> the probabilities they sample from (temperature,
        top-k, top-p, min-p)."""
        # a tiny temperature overflows as a tiny penalty does: kept finite (masked tokens stay at -inf)
        x = (x / torch.tensor([r.params.temperature for r in rr]).unsqueeze(1)).clamp(max=torch.finfo(x.dtype).max)
        # top_k beyond the vocabulary keeps every token; clamped so that any int fits the tensor
        top_k = torch.tensor([min(r.params.top_k, x.shape[1]) for r in rr])
        top_p = torch.tensor([r.params.top_p for r in rr])
        min_p = torch.tensor([r.params.min_p for r in rr])
        if bool((top_k > 0).any() | (top_p < 1).any() | (min_p > 0).any()):
            x = cls.truncate(x, top_k, top_p, min_p)
        return x.softmax(dim=1)

    def generator_of(self, req) -> torch.Generator:
        """The generator a request's random draws come from: its own (made from its seed) or the shared one."""
        if req.params.seed is None:
            return self.generator
        if req.generator is None:
            req.generator = torch.Generator().manual_seed(req.params.seed)
        return req.generator

    def distribution(self, logits: torch.Tensor, reqs: list) -> tuple[torch.Tensor, torch.Tensor]:
        """What each row samples from, without drawing (speculative decoding's rejection sampler compares a
        draft's and the target's): the processed logits (for logprobs) and the probabilities, after every
        transform; a greedy row's is a point mass on its argmax."""
        logits, _ = self._processed(logits, reqs)
        probs = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=1, keepdim=True), 1.0)
        rand_rows = [i for i, r in enumerate(reqs) if r.params.temperature > 0]
        if rand_rows:
            probs[rand_rows] = self._probs(logits[rand_rows], [reqs[i] for i in rand_rows])
        return logits, probs

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """logits [len(reqs), V] float32 -> one token per request (plus logprobs where asked)."""
        B = logits.shape[0]
        assert B == len(reqs)
        logits, mask_time = self._processed(logits, reqs)
        temps = [r.params.temperature for r in reqs]
        tokens = argmax_rows(logits)
        rand_rows = [i for i, t in enumerate(temps) if t > 0]
        if rand_rows:
            rr = reqs if len(rand_rows) == B else [reqs[i] for i in rand_rows]
            probs = self._probs(logits if len(rand_rows) == B else logits[rand_rows], rr)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for j, r in enumerate(rr):
                if r.params.seed is not None:
                    noise[j] = torch.empty(probs.shape[1]).exponential_(generator=self.generator_of(r))
            picked = (probs / noise).argmax(dim=1)
            if len(rand_rows) == B:
                tokens = picked
            else:
                tokens[rand_rows] = picked
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self.logprobs(logits, reqs, token_list), mask_time)

    @staticmethod
    def logprobs(logits: torch.Tensor, reqs: list, token_list: list[int]) -> list[dict[int, float] | None]:
        """Each row's logprobs of its chosen token and its top ``params.logprobs`` (None where not asked), from
        the processed logits."""
        B = len(reqs)
        logprobs: list[dict[int, float] | None] = [None] * B
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if lp_rows:
            lp = logits[lp_rows].log_softmax(dim=1)
            chosen = lp.gather(1, torch.tensor([token_list[i] for i in lp_rows]).unsqueeze(1)).squeeze(1).tolist()
            n_top = max(reqs[i].params.logprobs for i in lp_rows)
            top_v, top_i = (lp.topk(min(n_top, lp.shape[1]), dim=1) if n_top else (None, None))
            top_v = top_v.tolist() if n_top else None
            top_i = top_i.tolist() if n_top else None
            for j, i in enumerate(lp_rows):
                d = {token_list[i]: chosen[j]}
                n = reqs[i].params.logprobs
                if n:
                    for t, v in zip(top_i[j][:n], top_v[j][:n]):
                        if v > float("-inf"):   # fewer than n tokens are allowed by the row's grammar
                            d.setdefault(t, v)
                logprobs[i] = d
        return logprobs
