"""Request: the record of one sequence (tokens, progress, status) and who writes each of its facts.

The scheduler writes progress (``num_computed_tokens``), ``status``, the generated tokens and the stop
reason; the KV cache manager extends ``block_hashes`` (its blocks live in the manager, by request id);
the sampler owns ``generator``; the executor appends ``logprobs`` and attaches ``grammar`` (the matcher of a
request with ``structured_output``, once its grammar is compiled; it advances on each generated token).
``adapter`` (a LoRA adapter, set at submission) salts the prefix-cache hash chain (``cache_salt``); the
scheduler writes ``lora_slot`` (the adapter pool slot the request holds while it runs). The executor's proposer
writes ``spec_token_ids`` (speculative decoding: tokens the next step verifies); the scheduler trims or clears them.
"""

from __future__ import annotations

import enum
import time

from kiln.contract import NO_ADAPTER
from kiln.runtime.outputs import BATCH_PRIORITY, RequestMetrics
from kiln.runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"      # waiting again, to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """One request. Progress is only ``num_computed_tokens`` vs ``num_tokens``: a request whose
    computed tokens trail its tokens by more than one is (re)filling its context, by exactly one it decodes.
    """

    __slots__ = (
        "request_id", "prompt", "prompt_token_ids", "output_token_ids", "all_token_ids", "params", "priority",
        "arrival_time", "rank_time", "seq", "status", "num_computed_tokens", "block_hashes", "max_tokens",
        "metrics", "stop_reason", "logprobs", "generator", "num_prompt_tokens", "eos_token_ids", "grammar",
        "adapter", "cache_salt", "lora_slot", "spec_token_ids", "paced",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int,
                 priority: int = 0, arrival_time: float | None = None, seq: int = 0, prompt: str | None = None,
                 eos_token_ids: tuple[int, ...] = (), adapter=None, paced: bool = True):
        self.request_id = request_id
        # someone reads its tokens as they come, so its steps keep the decode pace: not a batch request's
        self.paced = paced and priority > BATCH_PRIORITY
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.rank_time = self.arrival_time  # its place in the queue (the scheduler adds its prompt's lead)
        self.seq = seq                      # submission order, breaks ties between equal arrivals
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []  # hash chain of this request's full blocks (grows as it generates)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time, priority=priority)
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.generator = None
        self.eos_token_ids = eos_token_ids
        self.grammar = None   # kiln.runtime.grammar.RequestGrammar of a structured-output request
        self.adapter = adapter              # kiln.runtime.adapters.LoraAdapter, or None: the base model
        # the same tokens under another adapter (or another load of it) have other KV: never shared
        self.cache_salt: bytes | None = None if adapter is None else b"lora:%d" % adapter.adapter_id
        self.lora_slot = NO_ADAPTER
        self.spec_token_ids: list[int] = []   # proposals to verify in its next step (speculative decoding)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def order_key(self) -> tuple:
        """Scheduling order: higher priority first, then earlier ``rank_time`` (the arrival, FCFS, unless the
        scheduler's short-prompt lead moves long prompts back)."""
        return (-self.priority, self.rank_time, self.seq)

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
