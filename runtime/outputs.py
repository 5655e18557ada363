"""What a request gives back: RequestOutput (cumulative, with the latest delta) and its timing metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

# The priority of batch work (kiln run-batch, the server's /v1/batches): below any other, so every other request
# is admitted first and, under max_utilization, preempts it. Requests at it are the "batch" class (metrics per
# class, ExecutorConfig.batch_max_share); every other request is "online".
BATCH_PRIORITY = -(2**31)
REQUEST_CLASSES = ("online", "batch")


def request_class(priority: int) -> str:
    return "batch" if priority <= BATCH_PRIORITY else "online"


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic()`` seconds) of a request's life, and the latencies derived from them.

    queue_time = first_scheduled - arrival; ttft = first_token - arrival;
    mean_tpot = (last_token - first_token) / (generated tokens - 1), the mean inter-token latency.
    priority is the request's (higher runs first; under max_utilization it may preempt lower ones).
    """

    arrival_time: float
    priority: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0      # prompt tokens whose KV came from the prefix cache
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def mean_tpot(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def as_dict(self) -> dict:
        return {
            "arrival_time": self.arrival_time, "first_scheduled_time": self.first_scheduled_time,
            "first_token_time": self.first_token_time, "finished_time": self.finished_time,
            "queue_time": self.queue_time, "ttft": self.ttft, "mean_tpot": self.mean_tpot,
            "e2e_latency": self.e2e_latency, "num_generated_tokens": self.num_generated_tokens,
            "num_cached_tokens": self.num_cached_tokens, "num_preemptions": self.num_preemptions,
            "priority": self.priority,
        }


@dataclass
class RequestOutput:
    """The state of one request: cumulative tokens and text, plus what is new since the last output.

    finish_reason is None while running, else "stop" (EOS, a stop token or a stop string), "length"
    (max_tokens or the engine's max_seq_len), "abort" (aborted, or the step loop failed: see ``error``).
    logprobs: one dict per generated token ({token_id: logprob}, the sampled token first) when requested.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    stop_reason: str | int | None = None   # the stop string or stop token id that ended it, if any
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
