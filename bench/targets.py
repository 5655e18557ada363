"""What a benchmark sends requests to: an in-process ``LLM``, an OpenAI-compatible HTTP endpoint, or a kiln model
behind NVIDIA Triton Inference Server (gRPC streaming).

Both are measured from the client side: a request's clock starts when the client sends it, its first
token is the first streamed output that carries text or tokens, its last token the last such output.
Each request ends in exactly one outcome: completed, failed (with a kind), rejected (HTTP 429, a full
queue) or aborted (the client gave up, or the server ended it with finish_reason "abort").

Metrics: ``metrics()`` returns the target's server-side numbers under the canonical names of
:data:`METRIC_NAMES` (from ``LLM.stats()`` in-process, from the server's Prometheus ``/metrics`` otherwise),
or {} when it has none.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field

from kiln.bench import disagg

COMPLETED, FAILED, REJECTED, ABORTED = "completed", "failed", "rejected", "aborted"
OUTCOMES = (COMPLETED, FAILED, REJECTED, ABORTED)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in ``time.perf_counter()`` seconds while it runs, then
    seconds from the start of the run (``shift``)."""

    index: int
    scheduled: float                 # when the schedule said to send it
    prompt_len: int
    output_len: int                  # tokens asked for (forced with ignore_eos / min_tokens)
    sent: float | None = None        # when it was actually sent (sent - scheduled = the client's lag)
    first_token: float | None = None
    last_token: float | None = None
    done: float | None = None
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)   # arrival of each streamed chunk with output
    outcome: str | None = None
    error_kind: str | None = None
    error: str | None = None
    finish_reason: str | None = None
    queue_time: float | None = None  # the server's own queue time, when it reports one per request
    cached_tokens: int | None = None
    preemptions: int | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None or self.sent is None else self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.last_token is None or self.output_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.done is None or self.sent is None else self.done - self.sent

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def shift(self, origin: float) -> None:
        """Make every time relative to ``origin``."""
        for name in ("scheduled", "sent", "first_token", "last_token", "done"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, v - origin)
        self.token_times = [t - origin for t in self.token_times]

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("token_times")
        d.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return d


class InProcessTarget:
    """An ``LLM`` in this process (``--engine DIR``); per-request queue time comes from the runtime."""

    kind = "in-process"

    def __init__(self, llm):
        self.llm = llm

    def describe(self) -> dict:
        return {"kind": self.kind, "engine": str(self.llm.engine.directory), "limits": asdict(self.llm.executor.limits),
                "capacity_policy": self.llm.executor.scheduler.config.capacity_policy,
                "prefix_reuse": self.llm.executor.kv.enable_prefix_reuse}

    def metrics(self) -> dict[str, float]:
        s = self.llm.stats()
        c, g = s["counters"], s["gauges"]
        out = {k: float(g[k]) for k in ("running", "waiting", "kv_usage", "kv_blocks_used", "kv_blocks_total",
                                          "prefix_hit_rate") if k in g}
        out.update({k: float(c[src]) for k, src in (("preemptions", "preemptions"), ("steps", "steps"),
                                                    ("prefill_tokens", "prefill_tokens_computed"),
                                                    ("generation_tokens", "generation_tokens"),
                                                    ("step_time_sum", "step_time"), ("engine_time_sum", "engine_time"))
                    if src in c})
        spec = s.get("speculative") or {}
        out.update({f"spec_{k}": float(spec[k]) for k in ("proposed_tokens", "accepted_tokens", "verify_steps")
                    if k in spec})
        out.update(disagg.from_stats(s))
        return out

    def steps(self) -> list:
        return list(self.llm.executor.metrics.steps)

    async def send(self, rec: RequestRecord, prompt: list[int]) -> None:
        from kiln.contract import ExecutorClosedError, InvalidRequestError
        from kiln.runtime import SamplingParams

        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def cb(out) -> None:
            loop.call_soon_threadsafe(q.put_nowait, (time.perf_counter(), out))

        params = SamplingParams(max_tokens=rec.output_len, min_tokens=rec.output_len, ignore_eos=True, temperature=0)
        rec.sent = time.perf_counter()
        try:
            rid = self.llm.executor.submit(prompt, params, callback=cb)
        except InvalidRequestError as exc:
            rec.done, rec.outcome, rec.error_kind, rec.error = time.perf_counter(), FAILED, "invalid_request", str(exc)
            return
        except ExecutorClosedError as exc:
            rec.done, rec.outcome, rec.error_kind, rec.error = time.perf_counter(), FAILED, "engine_closed", str(exc)
            return
        try:
            while True:
                t, out = await q.get()
                if out.delta_token_ids:
                    rec.first_token = t if rec.first_token is None else rec.first_token
                    rec.last_token = t
                    rec.token_times.append(t)
                if out.finished:
                    rec.done = t
                    rec.output_tokens = len(out.token_ids)
                    rec.finish_reason = out.finish_reason
                    rec.queue_time = out.metrics.queue_time
                    rec.cached_tokens = out.metrics.num_cached_tokens
                    rec.preemptions = out.metrics.num_preemptions
                    if out.error:
                        rec.outcome, rec.error_kind, rec.error = FAILED, "engine_error", out.error
                    elif out.finish_reason == "abort":
                        rec.outcome, rec.error_kind = ABORTED, "server_abort"
                    else:
                        rec.outcome = COMPLETED
                    return
        except asyncio.CancelledError:
            self.llm.executor.abort(rid)
            rec.done, rec.outcome, rec.error_kind = time.perf_counter(), ABORTED, "client_timeout"
            raise

    async def close(self) -> None:
        pass


class OpenAITarget:
    """An OpenAI-compatible server: streaming ``POST /v1/completions`` with a token-id prompt.

    Lengths are forced with ``ignore_eos`` and ``min_tokens`` (extensions kiln and vLLM accept); a server
    that ignores them may stop early at EOS, which shows as ``short_outputs`` in the report. The output
    token count is the server's ``usage.completion_tokens`` (asked for with ``stream_options``) or, when it
    sends no usage, the number of streamed chunks with text.
    """

    kind = "openai"

    def __init__(self, base_url: str, *, model: str | None = None, metrics_url: str | None = "auto",
                 api_key: str | None = None, request_timeout: float | None = None, force_lengths: bool = True):
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.metrics_url = f"{self.base_url}/metrics" if metrics_url == "auto" else metrics_url
        self.force_lengths = force_lengths
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=30.0), headers=headers,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self._metrics_client = httpx.Client(timeout=5.0, headers=headers)
        self.usage_reported = 0

    def describe(self) -> dict:
        return {"kind": self.kind, "endpoint": self.base_url, "model": self.model, "metrics_url": self.metrics_url,
                "lengths_forced_with": "ignore_eos + min_tokens" if self.force_lengths else "max_tokens only"}

    async def resolve_model(self) -> None:
        """The first model the server lists, when none was given."""
        if self.model:
            return
        try:
            r = await self.client.get(f"{self.base_url}/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        except Exception as exc:  # noqa: BLE001 - any failure means the same thing here
            raise ConnectionError(f"{self.base_url}/v1/models did not name a model ({type(exc).__name__}: {exc}); "
                                  "pass --model NAME") from None

    def metrics(self) -> dict[str, float]:
        if not self.metrics_url:
            return {}
        try:
            r = self._metrics_client.get(self.metrics_url)
        except Exception:  # noqa: BLE001 - a server without /metrics is measured from the client only
            return {}
        return canonical_metrics(parse_prometheus(r.text)) if r.status_code == 200 else {}

    def steps(self) -> list:
        return []

    async def send(self, rec: RequestRecord, prompt: list[int]) -> None:
        import httpx

        body = {"model": self.model, "prompt": prompt, "max_tokens": rec.output_len, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.force_lengths:
            body.update(ignore_eos=True, min_tokens=rec.output_len)
        rec.sent = time.perf_counter()
        chunks = 0
        usage = None
        try:
            async with self.client.stream("POST", f"{self.base_url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:300]
                    rec.done = time.perf_counter()
                    rec.outcome = REJECTED if resp.status_code == 429 else FAILED
                    rec.error_kind, rec.error = f"http_{resp.status_code}", text
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    t = time.perf_counter()
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        rec.done, rec.outcome, rec.error_kind = t, FAILED, "bad_stream"
                        rec.error = f"not JSON: {data[:200]}"
                        return
                    if "error" in obj:
                        rec.done, rec.outcome, rec.error_kind = t, FAILED, "stream_error"
                        rec.error = json.dumps(obj["error"])[:300]
                        return
                    usage = obj.get("usage") or usage
                    for choice in obj.get("choices") or []:
                        if choice.get("text"):
                            chunks += 1
                            rec.first_token = t if rec.first_token is None else rec.first_token
                            rec.last_token = t
                            rec.token_times.append(t)
                        if choice.get("finish_reason"):
                            rec.finish_reason = choice["finish_reason"]
        except asyncio.CancelledError:
            rec.done, rec.outcome, rec.error_kind = time.perf_counter(), ABORTED, "client_timeout"
            raise
        except httpx.HTTPError as exc:
            rec.done, rec.outcome, rec.error_kind = time.perf_counter(), FAILED, f"connection_{type(exc).__name__}"
            rec.error = str(exc)[:300]
            return
        rec.done = time.perf_counter()
        if usage and usage.get("completion_tokens") is not None:
            rec.output_tokens = int(usage["completion_tokens"])
            self.usage_reported += 1
        else:
            rec.output_tokens = chunks
        if rec.finish_reason == "abort":
            rec.outcome, rec.error_kind = ABORTED, "server_abort"
        elif rec.finish_reason is None:
            rec.outcome, rec.error_kind = FAILED, "truncated_stream"
            rec.error = "the stream ended without a finish_reason"
        else:
            rec.outcome = COMPLETED

    async def close(self) -> None:
        await self.client.aclose()
        self._metrics_client.close()


class TritonTarget:
    """A kiln model served by NVIDIA Triton Inference Server (``kiln serve --frontend triton``, or a repository from
    ``kiln triton-repo``): gRPC streaming (tritonclient's asyncio client), one bidirectional stream per request,
    with TensorRT-LLM's tensor names as kiln's model takes them (serving/triton/tensors.py): ``input_ids``,
    ``max_tokens``, ``stream``, and ``end_id`` -1 with ``min_tokens`` to force lengths. The last response is the
    one with ``finish_reason``; an ``overloaded`` error (the model's max_queue_size) counts as rejected.
    Server metrics come from Triton's metrics port (``--metrics-url``), summed over model instances; the model
    refreshes its gauges and counters about once a second, so a short run's deltas can miss its last second."""

    kind = "triton"

    def __init__(self, url: str, *, model: str | None = None, metrics_url: str | None = None,
                 request_timeout: float | None = None, force_lengths: bool = True):
        try:
            import tritonclient.grpc.aio as grpcclient
        except ImportError:
            raise ConnectionError("--api triton needs tritonclient: pip install 'kiln-llm[triton]'") from None
        self.url = url.split("://", 1)[-1].rstrip("/")
        self.model = model or "kiln"
        self.metrics_url = metrics_url
        self.request_timeout = request_timeout
        self.force_lengths = force_lengths
        self._grpc = grpcclient
        self.client = None   # made in the event loop that sends (grpc.aio binds to the loop it starts in)
        self._metrics_client = None

    def describe(self) -> dict:
        return {"kind": self.kind, "endpoint": self.url, "model": self.model, "metrics_url": self.metrics_url,
                "protocol": "gRPC stream_infer, one stream per request",
                "lengths_forced_with": "end_id -1 + min_tokens" if self.force_lengths else "max_tokens only"}

    def metrics(self) -> dict[str, float]:
        if not self.metrics_url:
            return {}
        import httpx

        if self._metrics_client is None:
            self._metrics_client = httpx.Client(timeout=5.0)
        try:
            r = self._metrics_client.get(self.metrics_url)
        except Exception:  # noqa: BLE001 - measured from the client only
            return {}
        return triton_metrics(parse_prometheus(r.text)) if r.status_code == 200 else {}

    def steps(self) -> list:
        return []

    def _inputs(self, prompt: list[int], n: int) -> list:
        import numpy as np

        arrays = {"input_ids": np.array([prompt], np.int32), "max_tokens": np.array([[n]], np.int32),
                  "stream": np.array([[True]])}
        if self.force_lengths:
            arrays.update(end_id=np.array([[-1]], np.int32), min_tokens=np.array([[n]], np.int32))
        inputs = []
        for name, arr in arrays.items():
            x = self._grpc.InferInput(name, list(arr.shape), "BOOL" if arr.dtype == bool else "INT32")
            x.set_data_from_numpy(arr)
            inputs.append(x)
        return inputs

    async def send(self, rec: RequestRecord, prompt: list[int]) -> None:
        finished = asyncio.Event()
        request = {"model_name": self.model, "inputs": self._inputs(prompt, rec.output_len),
                   "request_id": str(rec.index)}

        async def requests():
            yield request
            await finished.wait()   # keep the stream open until the last response

        if self.client is None:
            self.client = self._grpc.InferenceServerClient(self.url)
        rec.sent = time.perf_counter()
        responses = self.client.stream_infer(requests(), stream_timeout=self.request_timeout)
        try:
            async for result, error in responses:
                t = time.perf_counter()
                if error is not None:
                    message = error.message() if hasattr(error, "message") else str(error)
                    rec.done, rec.error = t, message[:300]
                    rec.outcome = REJECTED if "overloaded" in message else FAILED
                    rec.error_kind = "overloaded" if rec.outcome == REJECTED else "triton_error"
                    return
                ids = result.as_numpy("output_ids")
                n = 0 if ids is None else ids.size
                if n:
                    rec.first_token = t if rec.first_token is None else rec.first_token
                    rec.last_token = t
                    rec.token_times.append(t)
                    rec.output_tokens += n
                reason = result.as_numpy("finish_reason")
                if reason is not None:
                    rec.done, rec.finish_reason = t, reason.reshape(-1)[0].decode()
                    if rec.finish_reason == "abort":
                        rec.outcome, rec.error_kind = ABORTED, "server_abort"
                    else:
                        rec.outcome = COMPLETED
                    return
            rec.done, rec.outcome, rec.error_kind = time.perf_counter(), FAILED, "truncated_stream"
            rec.error = "the stream ended without a finish_reason"
        except asyncio.CancelledError:
            responses.cancel()
            rec.done, rec.outcome, rec.error_kind = time.perf_counter(), ABORTED, "client_timeout"
            raise
        finally:
            finished.set()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self._metrics_client is not None:
            self._metrics_client.close()


def parse_prometheus(text: str | None) -> dict[str, float]:
    """Flat {sample name (with labels): value} of a Prometheus exposition; {} for None."""
    if not text:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = float(s.value)
    return out


# canonical name -> Prometheus sample names, kiln serve's first (other servers: add their names here)
METRIC_NAMES = {
    "running": ("kiln_num_requests_running", "kiln_running", "vllm:num_requests_running"),
    "waiting": ("kiln_num_requests_waiting", "kiln_waiting", "vllm:num_requests_waiting"),
    "kv_usage": ("kiln_kv_cache_usage_ratio", "kiln_kv_usage", "vllm:kv_cache_usage_perc"),
    "kv_blocks_used": ("kiln_kv_cache_blocks_used", "kiln_kv_blocks_used"),
    "kv_blocks_total": ("kiln_kv_cache_blocks_total", "kiln_kv_blocks_total"),
    "prefix_hit_rate": ("kiln_prefix_cache_hit_rate", "kiln_prefix_hit_rate"),
    "preemptions": ("kiln_preemptions_total", "vllm:num_preemptions_total"),
    "steps": ("kiln_steps_total",),
    "prefill_tokens": ("kiln_prefill_tokens_computed_total",),
    "generation_tokens": ("kiln_generation_tokens_total", "vllm:generation_tokens_total"),
    "step_time_sum": ("kiln_step_time_seconds_sum",),
    "spec_proposed_tokens": ("kiln_spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
    "spec_accepted_tokens": ("kiln_spec_decode_num_accepted_tokens_total",
                             "vllm:spec_decode_num_accepted_tokens_total"),
    "spec_verify_steps": ("kiln_spec_decode_num_verify_steps_total",),
}
QUEUE_HISTOGRAMS = ("kiln_request_queue_time_seconds", "kiln_queue_time_seconds", "vllm:request_queue_time_seconds")


def canonical_metrics(samples: dict[str, float]) -> dict:
    """The numbers kiln bench reads, under canonical names; the queue-time histogram as
    ``queue_sum`` / ``queue_count`` / ``queue_buckets`` (cumulative (le, count)). Labelled series (vLLM labels
    each by engine and model_name) are summed over their labels other than a histogram's ``le``."""
    out: dict = {}
    labelled, samples = samples, _drop_labels(samples)
    for key, names in METRIC_NAMES.items():
        for n in names:
            if n in samples:
                out[key] = samples[n]
                break
    for h in QUEUE_HISTOGRAMS:
        if f"{h}_count" in samples:
            out.update(queue_sum=samples.get(f"{h}_sum", 0.0), queue_count=samples[f"{h}_count"],
                       queue_buckets=histogram_buckets(samples, h))
            break
    out.update(disagg.from_samples(samples, labelled))   # a PD server's KV transfer, TTFT split, per-role series
    return out


def _drop_labels(samples: dict[str, float]) -> dict[str, float]:
    """``parse_prometheus``'s samples with every label but ``le`` dropped, the series that differed only in those
    summed (``name{engine="0",model_name="m"}`` -> ``name``)."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        name, brace, labels = key.partition("{")
        if brace:
            le = next((p for p in labels.rstrip("}").split(",") if p.startswith("le=")), None)
            key = f"{name}{{{le}}}" if le else name
        out[key] = out.get(key, 0.0) + value
    return out


def triton_metrics(samples: dict[str, float]) -> dict:
    """Canonical numbers from kiln's Triton model metrics (serving/triton/metrics.py), summed over instances."""
    def total(name: str, **labels) -> float | None:
        hits = [v for k, v in samples.items() if k.split("{")[0] == name
                and all(f'{lk}="{lv}"' in k for lk, lv in labels.items())]
        return sum(hits) if hits else None

    out = {"running": total("nv_trt_llm_request_metrics", request_type="scheduled"),
           "waiting": total("nv_trt_llm_request_metrics", request_type="waiting"),
           "kv_blocks_used": total("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used"),
           "kv_blocks_total": total("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max"),
           "preemptions": total("kiln_preemptions_total"),
           "steps": total("nv_trt_llm_general_metrics", general_type="iteration_counter"),
           "generation_tokens": total("kiln_generation_tokens_total")}
    if out["kv_blocks_used"] is not None and out["kv_blocks_total"]:
        out["kv_usage"] = out["kv_blocks_used"] / out["kv_blocks_total"]
    queue = "kiln_request_queue_time_seconds"
    count = total(f"{queue}_count")
    if count is not None:
        buckets: dict[float, float] = {}
        for k, v in samples.items():
            if k.startswith(f"{queue}_bucket{{"):
                le = k.split('le="', 1)[1].split('"', 1)[0]
                key = math.inf if le in ("+Inf", "Inf") else float(le)
                buckets[key] = buckets.get(key, 0.0) + v
        out.update(queue_sum=total(f"{queue}_sum") or 0.0, queue_count=count, queue_buckets=sorted(buckets.items()))
    return {k: v for k, v in out.items() if v is not None}


def histogram_buckets(samples: dict[str, float], name: str) -> list[tuple[float, float]]:
    """Cumulative (le, count) of histogram ``name`` from parsed samples."""
    out = []
    prefix = f'{name}_bucket{{le="'
    for k, v in samples.items():
        if k.startswith(prefix):
            le = k[len(prefix):-2]
            out.append((math.inf if le in ("+Inf", "Inf") else float(le), v))
    return sorted(out)
