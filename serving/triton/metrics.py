"""kiln's metrics on Triton's metrics endpoint (``:8002/metrics``), through the Python backend's custom metrics API.

Named like TensorRT-LLM's Triton backend where an equivalent exists (same family names and label keys, so its
dashboards work), otherwise like ``kiln serve``'s OpenAI frontend (serving/metrics.py: the same ``kiln_*`` names
for the same numbers). Every metric carries ``model`` and ``version`` (as TensorRT-LLM's) and ``instance`` (each
model instance is its own kiln LLM).

- ``nv_trt_llm_request_metrics`` (gauge, ``request_type``): active (this instance's requests in flight), max
  (kiln max_batch_size), scheduled (running in the last step), context (running, no token yet), waiting.
- ``nv_trt_llm_kv_cache_block_metrics`` (gauge, ``kv_cache_block_type``): max, free, used, tokens_per, fraction.
- ``nv_trt_llm_inflight_batcher_metrics`` (gauge, ``inflight_batcher_specific_metric``): total_context_tokens
  (prompt tokens computed per step, averaged since the last update), generation_requests.
- ``nv_trt_llm_general_metrics`` (gauge, ``general_type``): iteration_counter (steps), timestamp (unix s).
- ``nv_llm_input_token_len`` / ``nv_llm_output_token_len`` (histograms, ``response_metric_type``).
- ``kiln_time_to_first_token_seconds``, ``kiln_time_per_output_token_seconds``, ``kiln_request_queue_time_seconds``,
  ``kiln_e2e_request_latency_seconds``: histograms, one observation per finished request (the Python backend of
  the bundled server, 2.51, has histograms).
- ``kiln_step_batch_size`` (gauge, ``quantile`` 0.5/0.9/0.99 and ``mean``): a summary of sequences per step over
  kiln's recent-step window, as gauges (the runtime keeps the samples; there is no per-step hook).
- counters ``kiln_requests_finished_total`` (``finish_reason``: stop, length, abort, error),
  ``kiln_requests_refused_total`` (``reason``: invalid, overloaded: refused by this model before kiln),
  ``kiln_prompt_tokens_total``, ``kiln_generation_tokens_total``, ``kiln_preemptions_total``; gauges
  ``kiln_prefix_cache_hit_rate``, ``kiln_kv_cache_blocks_cached``, ``kiln_healthy`` (0 once the step loop failed).
- disaggregated mode only (``prefill_workers`` > 0), the OpenAI frontend's names: counters
  ``kiln_kv_transfer_bytes_total``, ``kiln_kv_transfer_blocks_total``, ``kiln_kv_transfers_total``,
  ``kiln_kv_transfers_failed_total``, ``kiln_disagg_prefix_routed_total``, ``kiln_disagg_prefix_routed_tokens_total``;
  gauges ``kiln_disagg_requests`` and ``kiln_disagg_workers_alive`` (``role``: prefill, decode).

Gauges and counters are refreshed from ``LLM.stats()`` about once a second.
"""

from __future__ import annotations

import time

from kiln.runtime import RequestOutput
from kiln.runtime.metrics import LATENCY_BUCKETS, OUTCOMES

TOKEN_LEN_BUCKETS = [10, 50, 100, 500, 1000]   # TensorRT-LLM's build_1_2_5_buckets(1000)
ROLES = ("prefill", "decode")


class TritonMetrics:
    def __init__(self, pb, model: str, version: str, instance: str, disagg: bool = False):
        self.pb = pb
        self.labels = {"model": model, "version": version, "instance": instance}
        self.families = []
        gauge, counter, histogram = pb.MetricFamily.GAUGE, pb.MetricFamily.COUNTER, pb.MetricFamily.HISTOGRAM

        def family(name: str, description: str, kind, key: str | None = None, values=(), buckets=None):
            fam = pb.MetricFamily(name=name, description=description, kind=kind)
            self.families.append(fam)
            extra = {} if buckets is None else {"buckets": list(buckets)}
            if key is None:
                return fam.Metric(labels=dict(self.labels), **extra)
            return {v: fam.Metric(labels={key: v, **self.labels}, **extra) for v in values}

        self.request = family("nv_trt_llm_request_metrics", "TRT LLM request metrics (kiln)", gauge, "request_type",
                              ("active", "max", "scheduled", "context", "waiting"))
        self.kv = family("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics (kiln)", gauge,
                         "kv_cache_block_type", ("max", "free", "used", "tokens_per", "fraction"))
        self.batcher = family("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight_batcher-specific metrics (kiln)",
                              gauge, "inflight_batcher_specific_metric",
                              ("total_context_tokens", "generation_requests"))
        self.general = family("nv_trt_llm_general_metrics", "General TRT LLM metrics (kiln)", gauge, "general_type",
                              ("iteration_counter", "timestamp"))
        self.input_len = family("nv_llm_input_token_len", "Prompt tokens per request", histogram,
                                "response_metric_type", ("total_input_tokens",),
                                TOKEN_LEN_BUCKETS)["total_input_tokens"]
        self.output_len = family("nv_llm_output_token_len", "Generated tokens per request", histogram,
                                 "response_metric_type", ("total_output_tokens",),
                                 TOKEN_LEN_BUCKETS)["total_output_tokens"]
        self.latency = {
            "ttft": family("kiln_time_to_first_token_seconds", "Time from arrival to the first token",
                           histogram, buckets=LATENCY_BUCKETS),
            "mean_tpot": family("kiln_time_per_output_token_seconds", "Mean time between a request's tokens",
                                histogram, buckets=LATENCY_BUCKETS),
            "queue_time": family("kiln_request_queue_time_seconds", "Time from arrival to the first step",
                                 histogram, buckets=LATENCY_BUCKETS),
            "e2e_latency": family("kiln_e2e_request_latency_seconds", "Time from arrival to the last token",
                                  histogram, buckets=LATENCY_BUCKETS),
        }
        self.batch_size = family("kiln_step_batch_size", "Sequences per step over kiln's recent steps (summary)",
                                 gauge, "quantile", ("0.5", "0.9", "0.99", "mean"))
        self.finished_by = family("kiln_requests_finished_total", "Requests that ended, by finish reason", counter,
                                  "finish_reason", OUTCOMES)
        self.refused_by = family("kiln_requests_refused_total", "Requests this model refused before kiln", counter,
                              "reason", ("invalid", "overloaded"))
        self.tokens = {
            "prompt_tokens": family("kiln_prompt_tokens_total", "Prompt tokens submitted", counter),
            "generation_tokens": family("kiln_generation_tokens_total", "Tokens generated", counter),
            "preemptions": family("kiln_preemptions_total", "Running requests preempted for KV space", counter),
        }
        self.prefix_hit_rate = family("kiln_prefix_cache_hit_rate", "Share of prefix lookups that found cached blocks",
                                      gauge)
        self.cached_blocks = family("kiln_kv_cache_blocks_cached", "KV blocks holding a reusable prefix", gauge)
        self.healthy = family("kiln_healthy", "1 while the step loop serves, 0 once it failed", gauge)
        self._last = {"steps": 0, "prefill_tokens_computed": 0, "prompt_tokens": 0, "generation_tokens": 0,
                      "preemptions": 0, **{f"outcome_{o}": 0 for o in OUTCOMES}}
        self.disagg_counters, self.disagg_roles = {}, {}
        if disagg:
            from kiln.serving.metrics import DISAGG_COUNTERS, DISAGG_ROUTING

            for key, (name, doc) in {**DISAGG_COUNTERS, **DISAGG_ROUTING}.items():
                self.disagg_counters[key] = family(f"kiln_{name}_total", doc, counter)
                self._last[f"disagg_{key}"] = 0
            self.disagg_roles = {
                "queues": family("kiln_disagg_requests", "Requests in flight by role (prefill: not yet handed to a "
                                 "decode worker)", gauge, "role", ROLES),
                "alive": family("kiln_disagg_workers_alive", "Live workers by role", gauge, "role", ROLES),
            }

    def refused(self, reason: str) -> None:
        """A request this model refused ("invalid", or "overloaded": over max_queue_size)."""
        self.refused_by[reason].increment(1)

    def finished(self, out: RequestOutput) -> None:
        """Histograms of one finished request."""
        m = out.metrics
        self.input_len.observe(len(out.prompt_token_ids))
        self.output_len.observe(len(out.token_ids))
        for name, metric in self.latency.items():
            value = getattr(m, name)
            if value is not None:
                metric.observe(value)

    def update(self, stats: dict, active: int, generating: int, healthy: bool) -> None:
        """Refresh gauges and counters from ``LLM.stats()``; ``active``/``generating``: this instance's requests
        in flight / those that already have a token."""
        c, g, cfg = stats["counters"], stats["gauges"], stats["config"]
        self.request["active"].set(active)
        self.request["max"].set(cfg["max_batch_size"])
        self.request["scheduled"].set(g["running"])
        self.request["context"].set(max(0, min(g["running"], active) - generating))
        self.request["waiting"].set(g["waiting"])
        total, used = g["kv_blocks_total"], g["kv_blocks_used"]
        self.kv["max"].set(total)
        self.kv["used"].set(used)
        self.kv["free"].set(total - used)
        self.kv["tokens_per"].set(cfg["tokens_per_block"])
        self.kv["fraction"].set(used / total if total else 0.0)
        steps = c["steps"] - self._last["steps"]
        if steps:
            self.batcher["total_context_tokens"].set(
                (c["prefill_tokens_computed"] - self._last["prefill_tokens_computed"]) / steps)
        self.batcher["generation_requests"].set(generating)
        self.general["iteration_counter"].set(c["steps"])
        self.general["timestamp"].set(time.time())
        batch = stats["histograms"]["batch_size"]
        for q, key in (("0.5", "p50"), ("0.9", "p90"), ("0.99", "p99"), ("mean", "mean")):
            if batch[key] is not None:
                self.batch_size[q].set(batch[key])
        for outcome, metric in self.finished_by.items():
            self._count(metric, stats["outcomes"][outcome], f"outcome_{outcome}")
        for name, metric in self.tokens.items():
            self._count(metric, c[name], name)
        self.prefix_hit_rate.set(g["prefix_hit_rate"])
        self.cached_blocks.set(g["kv_blocks_cached"])
        self.healthy.set(1 if healthy else 0)
        d = stats.get("disagg")
        if d is not None and self.disagg_counters:
            totals = {**d["kv_transfer"], **d["routing"]}
            for key, metric in self.disagg_counters.items():
                self._count(metric, totals[key], f"disagg_{key}")
            for role in ROLES:
                self.disagg_roles["queues"][role].set(d["queues"][role])
                self.disagg_roles["alive"][role].set(sum(w["alive"] for w in d["workers"] if w["role"] == role))
        self._last["steps"] = c["steps"]
        self._last["prefill_tokens_computed"] = c["prefill_tokens_computed"]

    def _count(self, metric, total: float, key: str) -> None:
        """Advance a Triton counter to the runtime's running total."""
        if total > self._last[key]:
            metric.increment(total - self._last[key])
        self._last[key] = total

    def close(self) -> None:
        """Drop the metrics before their families (the backend requires that order)."""
        for attr in ("request", "kv", "batcher", "general", "input_len", "output_len", "latency", "batch_size",
                     "finished_by", "refused_by", "tokens", "prefix_hit_rate", "cached_blocks", "healthy",
                     "disagg_counters", "disagg_roles"):
            setattr(self, attr, None)
        self.families.clear()
