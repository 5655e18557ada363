"""Prometheus exposition of the runtime's own numbers: a ``prometheus_client`` collector over ``LLM.stats()``.

The runtime keeps its counters, gauges and histograms (kiln.runtime.metrics) and knows nothing of HTTP;
each scrape reads one consistent snapshot and turns it into metric families here. Names follow
Prometheus conventions (``_seconds``, ``_total``, ``_ratio``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# runtime histogram -> (family name, help)
HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Time from a request's arrival to its first generated token."),
    "tpot": ("time_per_output_token_seconds", "Mean inter-token latency of each finished request (TPOT)."),
    "inter_token_latency": ("inter_token_latency_seconds", "Time between consecutive tokens of a request."),
    "e2e_latency": ("e2e_request_latency_seconds", "Time from a request's arrival to its end."),
    "queue_time": ("request_queue_time_seconds", "Time from a request's arrival to its first scheduled step."),
    "step_time": ("step_time_seconds", "Duration of one step of the step loop (schedule, engine, sample)."),
    "batch_size": ("batch_size", "Sequences per engine step (in-flight batching)."),
    "grammar_compile_time": ("grammar_compile_time_seconds",
                             "Time to compile a structured-output grammar against the vocabulary (off the step loop)."),
    "grammar_mask_time": ("grammar_mask_time_seconds",
                          "Time a step spent on the token bitmasks of its structured-output requests."),
}
COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens of submitted requests."),
    "generation_tokens": ("generation_tokens", "Generated tokens."),
    "prefill_tokens_computed": ("prefill_tokens_computed",
                                "Prompt tokens run through the engine (not taken from the prefix cache)."),
    "requests_submitted": ("requests_submitted", "Requests accepted by the runtime."),
    "requests_rejected": ("requests_rejected", "Requests refused: by the runtime at submission, and by the "
                          "server before they reached it (400 invalid, 413 too large, 429 overloaded)."),
    "preemptions": ("preemptions", "Requests preempted to free KV blocks (recomputed later)."),
    "steps": ("steps", "Steps of the step loop."),
    "structured_requests": ("structured_output_requests", "Requests submitted with a structured-output constraint."),
    "grammar_cache_hits": ("grammar_cache_hits",
                           "Structured-output requests whose grammar was compiled (or compiling) already."),
    "grammar_cache_misses": ("grammar_cache_misses", "Structured-output requests whose grammar had to be compiled."),
}
GAUGES = {
    "running": ("num_requests_running", "Requests in the running batch."),
    "waiting": ("num_requests_waiting", "Requests queued in the scheduler."),
    "kv_blocks_used": ("kv_cache_blocks_used", "KV blocks referenced by requests."),
    "kv_blocks_total": ("kv_cache_blocks_total", "KV blocks in the pool."),
    "kv_blocks_cached": ("kv_cache_blocks_cached", "KV blocks holding a reusable prefix."),
    "kv_usage": ("kv_cache_usage_ratio", "Share of the KV pool referenced by requests (0-1)."),
    "prefix_hit_rate": ("prefix_cache_hit_rate", "Share of looked-up prompt tokens found in the prefix cache (0-1)."),
}


class RuntimeCollector(Collector):
    """Metric families of one ``LLM`` (anything with ``stats()`` and ``executor.failure``); ``server_rejected``
    counts the requests the server in front of it refused, which ``requests_rejected`` includes."""

    def __init__(self, llm, prefix: str = "kiln", server_rejected: Callable[[], int] = lambda: 0):
        self.llm = llm
        self.prefix = prefix
        self.server_rejected = server_rejected

    def collect(self) -> Iterator[Metric]:
        p = self.prefix
        s = self.llm.stats()
        for key, (name, doc) in HISTOGRAMS.items():
            h = s["histograms"][key]
            yield HistogramMetricFamily(f"{p}_{name}", doc, sum_value=h["sum"],
                                        buckets=[(floatToGoString(le), n) for le, n in h["buckets"]])
        for key, (name, doc) in COUNTERS.items():
            extra = self.server_rejected() if key == "requests_rejected" else 0
            yield CounterMetricFamily(f"{p}_{name}", doc, value=s["counters"][key] + extra)
        outcomes = CounterMetricFamily(f"{p}_requests_finished", "Requests that ended, by finish reason "
                                       "(stop, length, abort, error = failed by the step loop).",
                                       labels=["finish_reason"])
        for reason, n in s["outcomes"].items():
            outcomes.add_metric([reason], n)
        yield outcomes
        kv = s["kv_cache"]
        yield CounterMetricFamily(f"{p}_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=kv["prefix_queries"])
        yield CounterMetricFamily(f"{p}_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=kv["prefix_hits"])
        yield CounterMetricFamily(f"{p}_kv_cache_evictions", "Cached prefix blocks evicted to make room.",
                                  value=kv["evictions"])
        for key, (name, doc) in GAUGES.items():
            yield GaugeMetricFamily(f"{p}_{name}", doc, value=s["gauges"][key])
        yield GaugeMetricFamily(f"{p}_healthy", "1 while the step loop serves, 0 once it stopped or failed.",
                                value=0 if self.llm.executor.failure else 1)
