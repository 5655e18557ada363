"""What the leader of a tensor-parallel engine tells the other ranks: one flat int64 broadcast per step.

Every rank runs the same step on its shard, so each needs the step's contract inputs except the KV pool
(each rank holds its own). The leader packs them into one int64 tensor behind a small header and
broadcasts it on the control group; the ranks unpack views of it. A step larger than the inline part
(a long prefill with wide block tables) takes a second broadcast of exactly its payload, so steps of any
size work while the common step (decode, small prefill) costs one broadcast of a fixed, small buffer.

Header (int64): op, num_tokens, num_seqs, block table width, num_logits, payload length, argument, 0.
Payload: input_ids, position_ids, slot_mapping [num_tokens each], seq_lens, context_lens [num_seqs each],
block_tables [num_seqs x width], logits_indices [num_logits].
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.contract import INDEX_DTYPES, EngineBounds

HEADER = 8
OP_STEP, OP_ALLOC, OP_STOP = 1, 2, 3
INLINE_LIMIT = 16384    # payload elements carried in the step's one broadcast (128 KiB)
_TOKEN_FIELDS = ("input_ids", "position_ids", "slot_mapping")
_SEQ_FIELDS = ("seq_lens", "context_lens")


def max_payload(bounds: EngineBounds) -> int:
    """Payload elements of the largest step the engine's bounds allow."""
    t, s = bounds.max_num_tokens, bounds.max_batch_size
    return 3 * t + 2 * s + s * bounds.max_blocks_per_seq + bounds.max_num_logits


@dataclass
class Message:
    op: int
    arg: int = 0
    inputs: dict[str, torch.Tensor] | None = None   # OP_STEP: the contract inputs but kv_cache


class StepChannel:
    """Both ends of the broadcast: ``send_*`` on rank 0, ``receive`` on the others (same bounds on every rank)."""

    def __init__(self, group: dist.ProcessGroup, bounds: EngineBounds):
        self.group = group
        self.inline = min(max_payload(bounds), INLINE_LIMIT)
        self.buf = torch.zeros(HEADER + self.inline, dtype=torch.int64)
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0
        self.seconds = 0.0     # spent in broadcasts (the benchmark reads it)
        self.calls = 0

    def _broadcast(self, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.group.broadcast([t], self._opts).wait()
        self.seconds += time.perf_counter() - t0
        self.calls += 1

    # ---- rank 0 -------------------------------------------------------------------------------------------
    def send_step(self, inputs: dict[str, torch.Tensor]) -> None:
        tables = inputs["block_tables"]
        t, s, w = inputs["input_ids"].numel(), tables.shape[0], tables.shape[1]
        n_logits = inputs["logits_indices"].numel()
        n = 3 * t + 2 * s + s * w + n_logits
        parts = [inputs[f] for f in _TOKEN_FIELDS] + [inputs[f] for f in _SEQ_FIELDS] + [tables,
                                                                                         inputs["logits_indices"]]
        self.buf[:HEADER] = torch.tensor([OP_STEP, t, s, w, n_logits, n, 0, 0])
        inline = n <= self.inline
        payload = self.buf[HEADER:HEADER + n] if inline else torch.empty(n, dtype=torch.int64)
        offset = 0
        for p in parts:
            k = p.numel()
            payload[offset:offset + k].copy_(p.reshape(-1))
            offset += k
        self._broadcast(self.buf)
        if not inline:
            self._broadcast(payload)

    def send(self, op: int, arg: int = 0) -> None:
        """A message without inputs: OP_ALLOC (arg = number of KV blocks) or OP_STOP."""
        self.buf[:HEADER] = torch.tensor([op, 0, 0, 0, 0, 0, arg, 0])
        self._broadcast(self.buf)

    # ---- the other ranks ----------------------------------------------------------------------------------
    def receive(self) -> Message:
        self._broadcast(self.buf)
        op, t, s, w, n_logits, n, arg, _ = self.buf[:HEADER].tolist()
        if op != OP_STEP:
            return Message(op, arg)
        if n <= self.inline:
            payload = self.buf[HEADER:HEADER + n]
        else:
            payload = torch.empty(n, dtype=torch.int64)
            self._broadcast(payload)
        sizes = [t, t, t, s, s, s * w, n_logits]
        names = [*_TOKEN_FIELDS, *_SEQ_FIELDS, "block_tables", "logits_indices"]
        inputs = {}
        for name, part in zip(names, payload.split(sizes)):
            inputs[name] = part.to(INDEX_DTYPES[name])   # int64 fields stay views of the buffer
        inputs["block_tables"] = inputs["block_tables"].view(s, w)
        return Message(op, arg, inputs)
