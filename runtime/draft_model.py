"""Draft-model speculation: a smaller kiln engine proposes each speculating sequence's next k tokens.

The draft is an engine directory loaded like the target (``Engine.from_dir``), refused with a ``ConfigError``
naming both engines when its vocabulary size or its tokenizer files (their checksums in the engine directories)
differ from the target's. It has its own KV pool and its own ``KVCacheManager`` (prefix reuse on, as the
target's): each sequence it drafts for is a ``_DraftSeq`` there, whose computed tokens are a prefix of the
target request's tokens plus the proposals it fed.

One proposal round (``propose_all``) for all the speculating sequences together: the draft first catches up
on the tokens it has not seen (the whole prompt the first time, then the tokens verified since its last round),
in as few engine runs as its bounds allow, then runs k - 1 single-token steps batched across the sequences.
Each round samples the draft token from the draft's distribution q after the request's own sampling transforms
(``Sampler.distribution``: temperature, top-k/p, min-p, penalties with the proposals before counted as
generated): greedy requests get the draft's argmax, sampled ones a draw from q (their own generator when
seeded), and q is kept for the rejection sampler (``kiln.runtime.rejection``).

Rollback: after a verify step the draft's ``num_computed_tokens`` goes back to the longest prefix of what it
fed that the target accepted, and blocks left empty are freed (``KVCacheManager.trim``); only then are its
full blocks offered to its prefix cache, so a registered block always holds the request's real tokens. A
preempted request's draft blocks are freed with its target blocks; an ended request's when it ends.

Memory: the executor sizes both pools from one budget, split by KV bytes per token so that both hold the same
number of tokens (every sequence lives in both): see ``Executor.__init__`` and docs/speculative.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from kiln.contract import ConfigError, KilnError, SeqChunk, pack_inputs
from kiln.runtime.kv_cache import KVCacheManager, cdiv
from kiln.runtime.sampler import Sampler
from kiln.runtime.speculative import Position, Proposer, SpeculativeConfig

logger = logging.getLogger("kiln.runtime")

# the tokenizer files that define the token ids (a chat template or generation settings may differ)
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def load_draft(path: str, target) -> Any:
    """The draft engine of ``speculative_config.model``, checked against the target (ConfigError otherwise)."""
    from kiln.runtime.engine import Engine

    if not Path(path).is_dir():
        raise ConfigError(f"speculative_config model {path!r} is not a directory; give a kiln engine directory "
                          "(build-engine writes one)")
    try:
        draft = Engine.from_dir(path)
    except KilnError as exc:
        raise ConfigError(f"speculative_config model {path!r} cannot be loaded as a draft engine: {exc}") from exc
    try:
        check_compatible(target, draft)
    except ConfigError:
        draft.close()
        raise
    return draft


def _vocab_checksums(engine) -> dict[str, str]:
    cfg = engine.config
    return {f: cfg.checksums.get(f, "?") for f in VOCAB_FILES if f in cfg.tokenizer.files}


def check_compatible(target, draft) -> None:
    """Refuse a draft whose token ids could mean other tokens than the target's (ConfigError naming both)."""
    names = f"draft engine {getattr(draft, 'directory', '?')}", f"target engine {getattr(target, 'directory', '?')}"
    dv, tv = draft.config.model.vocab_size, target.config.model.vocab_size
    if dv != tv:
        raise ConfigError(f"speculative_config: the {names[0]} has a vocabulary of {dv} tokens, the {names[1]} "
                          f"{tv}; a draft must share the target's vocabulary (build it from a checkpoint with the "
                          "target's tokenizer)")
    if getattr(draft.config, "lora", None) is not None:
        raise ConfigError(f"speculative_config: the {names[0]} was built to take LoRA adapters; a draft runs the "
                          "base model only: rebuild it without lora_target_modules")
    dt, tt = _vocab_checksums(draft), _vocab_checksums(target)
    if dt != tt:
        diff = sorted(f for f in set(dt) | set(tt) if dt.get(f) != tt.get(f))
        shown = "; ".join(f"{f}: {dt.get(f, 'absent')[:19]} vs {tt.get(f, 'absent')[:19]}" for f in diff)
        raise ConfigError(f"speculative_config: the {names[0]} and the {names[1]} have different tokenizers "
                          f"({shown}); a draft must share the target's tokenizer")


class _DraftSeq:
    """A target request as the draft's KV manager sees it: the request's tokens, the draft's own progress."""

    __slots__ = ("request", "num_computed_tokens", "block_hashes", "base", "fed")

    def __init__(self, request):
        self.request = request
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.base = 0                 # the request's num_tokens when the proposals in the pool were fed
        self.fed: list[int] = []      # those proposals (after position base - 1)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def cache_salt(self) -> bytes | None:
        return self.request.cache_salt


class DraftProposer(Proposer):
    """Proposals from a draft engine with its own KV pool (see the module docstring)."""

    round_per_position = True

    def __init__(self, config: SpeculativeConfig, draft, num_blocks: int, sampler: Sampler,
                 enable_prefix_reuse: bool = True):
        super().__init__(config)
        self.engine = draft
        b = draft.config.bounds
        self.bounds = b
        self.sampler = sampler
        self.kv = KVCacheManager(num_blocks, b.tokens_per_block, enable_prefix_reuse, draft.config.model.kv_window)
        self.kv_cache = draft.allocate_kv_cache(num_blocks)
        self._seqs: dict[str, _DraftSeq] = {}
        self._probs: dict[str, torch.Tensor] = {}

    # ---- the executor's side ----------------------------------------------------------------------
    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)
        self._probs.pop(request_id, None)
        super().forget(request_id)

    def release(self, requests: list) -> None:
        for req in requests:
            seq = self._seqs.pop(req.request_id, None)
            if seq is not None:
                self.kv.free(seq)
            self._probs.pop(req.request_id, None)

    def rolled_back(self, requests: list) -> None:
        for req in requests:
            seq = self._seqs.get(req.request_id)
            if seq is not None:
                self._rollback(seq)

    def close(self) -> None:
        self.engine.close()

    def fixed_k(self, request) -> bool:
        """A seeded sampled request: rejection sampling draws from its generator as its proposals go, so the same
        seed repeats its tokens only with the same k sequence (always the most, not a timing-driven choice)."""
        return request.params.temperature > 0 and request.generator is not None

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        return self._probs.get(request_id)

    def propose_all(self, wants: list[tuple[Any, int]]) -> None:
        try:
            self._propose(wants)
        except Exception:   # a failed draft costs its proposals, never the target's requests
            logger.exception("the draft engine failed; these requests go on without proposals")
            for req, _ in wants:
                req.spec_token_ids = []
            self.release([req for req, _ in wants])

    # ---- the draft's rounds -----------------------------------------------------------------------
    def _rollback(self, seq: _DraftSeq) -> None:
        """Back to the longest prefix of what the draft fed that the request's tokens still agree with; empty
        blocks freed; then its full blocks are offered to the prefix cache."""
        if seq.fed:
            toks = seq.all_token_ids
            a = 0
            while a < len(seq.fed) and seq.base + a < len(toks) and toks[seq.base + a] == seq.fed[a]:
                a += 1
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.base + a)
            seq.fed = []
            if self.kv.block_table(seq.request_id):
                self.kv.trim(seq)
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        self.kv.cache_blocks(seq)

    def _admit(self, req, k: int) -> _DraftSeq | None:
        """The request's draft sequence with slots for its catch-up and k - 1 proposals (None: no room)."""
        seq = self._seqs.get(req.request_id)
        if seq is None:
            seq = self._seqs[req.request_id] = _DraftSeq(req)
        self._rollback(seq)
        if not self.kv.block_table(seq.request_id):   # (again) new to the pool: its cached prefix first
            hits = self.kv.get_computed_blocks(seq)
            seq.num_computed_tokens = 0
            if not self.kv.allocate_slots(seq, seq.num_tokens - len(hits) * self.kv.block_size + k - 1, hits):
                return None
            seq.num_computed_tokens = len(hits) * self.kv.block_size
            return seq
        if not self.kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens + k - 1):
            return None
        return seq

    def _propose(self, wants: list[tuple[Any, int]]) -> None:
        bs = self.bounds
        live = []
        for req, k in wants:
            k = min(k, bs.max_seq_len - req.num_tokens)
            seq = self._admit(req, k) if k > 0 else None
            if seq is None:
                req.spec_token_ids = []
                continue
            seq.base, seq.fed = req.num_tokens, []
            req.spec_token_ids = []
            live.append((req, seq, k))
        feed = {req.request_id: req.all_token_ids[seq.num_computed_tokens:] for req, seq, _ in live}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _, _ in live}
        for j in range(max((k for _, _, k in live), default=0)):
            t0 = time.perf_counter()
            batch = [(req, seq) for req, seq, k in live if k > j]
            if j > 0:   # this round feeds the previous round's proposal
                for req, seq in batch:
                    seq.fed.append(req.spec_token_ids[j - 1])
            logits = self._forward([(seq, feed[req.request_id]) for req, seq in batch])
            views = [Position(req, j) for req, _ in batch]
            _, q = self.sampler.distribution(logits, views)
            tokens = self._draw(q, [req for req, _ in batch])
            for (req, _), t, row in zip(batch, tokens, q):
                req.spec_token_ids.append(t)
                probs[req.request_id].append(row)
                feed[req.request_id] = [t]
            self.policy.observe_round(len(batch), time.perf_counter() - t0)   # the policy's draft cost
        for req, _, _ in live:
            if req.params.temperature > 0:
                self._probs[req.request_id] = torch.stack(probs[req.request_id])
            else:
                self._probs.pop(req.request_id, None)

    def _draw(self, q: torch.Tensor, reqs: list) -> list[int]:
        """A draft token per row of q: the argmax for greedy requests, a draw from q for sampled ones."""
        tokens = q.argmax(dim=1)
        for i, r in enumerate(reqs):
            if r.params.temperature > 0:
                tokens[i] = torch.multinomial(q[i], 1, generator=self.sampler.generator_of(r))[0]
        return tokens.tolist()

    def _forward(self, items: list[tuple[_DraftSeq, list[int]]]) -> torch.Tensor:
        """Feed each sequence its tokens (after its computed ones) -> the draft's logits after each one's last
        token, [len(items), vocab]; as many engine runs as the draft's token and batch bounds need (a long
        catch-up is split: its first chunks take no logits row)."""
        b = self.bounds
        out: list[torch.Tensor | None] = [None] * len(items)
        todo = sorted(range(len(items)), key=lambda i: len(items[i][1]) == 1)   # context chunks first
        rest = {i: items[i][1] for i in todo}
        while todo:
            chunks, owners, budget, advanced = [], [], b.max_num_tokens, []
            while todo and len(chunks) < b.max_batch_size and budget > 0:
                i = todo[0]
                seq, toks = items[i][0], rest[i]
                take = toks[:budget]
                last = len(take) == len(toks)
                chunks.append(SeqChunk(take, seq.num_computed_tokens, self.kv.block_table(seq.request_id),
                                       1 if last else 0))
                advanced.append((seq, len(take)))
                budget -= len(take)
                if last:
                    owners.append(todo.pop(0))
                else:
                    rest[i] = toks[len(take):]
                    break
            logits = self.engine.run(pack_inputs(chunks, self.kv_cache, self.kv.block_size))
            for seq, n in advanced:
                seq.num_computed_tokens += n
            for row, i in enumerate(owners):
                out[i] = logits[row]
        return torch.stack(out)


def draft_pool_blocks(target_blocks: int, target_block_size: int, b) -> int:
    """The draft pool for a target pool of ``target_blocks``: the same tokens (capped by the draft's bounds ``b``;
    the executor's sizing and ``kiln plan``'s)."""
    blocks = cdiv(target_blocks * target_block_size, b.tokens_per_block)
    return min(blocks, b.max_num_blocks) if b.max_num_blocks else blocks
