"""The Triton Python-backend model: each model instance runs one kiln ``LLM`` and serves Triton requests with it.

``execute`` parses each request, submits it to the LLM (``LLM.submit`` with a callback) and returns at once, so
every Triton request joins kiln's step loop as soon as it arrives and requests in flight batch together. The
callback runs on the step loop and only enqueues; one sender thread per instance turns kiln outputs into
responses (every delta when streaming, one response otherwise, the last one with the FINAL flag; deltas that
queued up while earlier responses were being sent go out together, so a slow client path delays tokens by
at most one send instead of piling up), checks every
100 ms whether clients cancelled (then aborts the kiln request, freeing its KV blocks) and refreshes the
metrics about once a second, and within 100 ms of a new request (so a short one still shows in flight).
Responses go through the request's response sender in both decoupled and
non-decoupled mode, which is what lets a non-decoupled model return from ``execute`` before it has answered.

Errors are sent as Triton errors: INVALID_ARG for a bad request (naming the tensor and the rule), UNAVAILABLE
for "overloaded" (more than ``max_queue_size`` requests of this instance wait for their first token, or too many
large prompts wait to be tokenized) and when the LLM is shut down, CANCELLED for a cancelled request, INTERNAL
when the step loop failed.

A request whose inputs are large (a long ``text_input``) is checked and tokenized in a prompt worker thread
(kiln.serving.prompt_workers) after its cheap checks (size, parameters, the prompt's byte bound), so that
``execute`` returns at once and the requests behind it are not held up; small ones are handled in ``execute``.

Only Triton's Python-backend stub imports this module (``triton_python_backend_utils`` exists only there).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import triton_python_backend_utils as pb

from kiln.contract import AdapterLoadError, EngineLoadError
from kiln.runtime import ConfigError, Engine, ExecutorClosedError, InvalidRequestError, RequestOutput
from kiln.serving.prompt_bounds import PromptBounds, tokenize
from kiln.serving.prompt_workers import Busy, PromptWorkers
from kiln.serving.triton.metrics import TritonMetrics
from kiln.serving.triton.protocol import (
    BadRequest,
    EngineLimits,
    ParsedRequest,
    check_envelope,
    parse_request,
    request_bytes,
    response_tensors,
)
from kiln.serving.triton.repository import check_disagg, check_runtime, lora_modules, read_disagg, read_parameters

CANCEL_CHECK_S = 0.1
STATS_PERIOD_S = 1.0
# finalize's wait for the sender thread: well inside tritonserver's exit timeout (10 s), which a slower
# finalize turns into a non-graceful exit with code 1
SENDER_JOIN_S = 3.0
_STOP = object()


@dataclass
class _Stream:
    """A Triton request in flight: where its responses go and how to build them."""

    request: object          # pb.InferenceRequest (kept for is_cancelled)
    sender: object           # its response sender
    parsed: ParsedRequest
    prompt_text: str
    request_id: str = ""
    has_token: bool = False
    cancelled: bool = False
    done: bool = False


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        engine_dir = Path(params.get("engine_dir", ""))
        if not engine_dir.is_absolute():   # a copied engine (triton-repo --copy-engine) sits next to model.py
            engine_dir = Path(args["model_repository"]) / args["model_version"] / engine_dir
        bounds = Engine.read_config(engine_dir).bounds
        try:
            runtime, self.max_queue_size = read_parameters(params)
            check_runtime(runtime, self.max_queue_size, bounds)
            disagg = read_disagg(params)
            instances = sum(g.get("count", 1) for g in config.get("instance_group", [])) or 1
            check_disagg(disagg, instances, params.get("lora_modules", ""))
            adapters = lora_modules(params.get("lora_modules", ""))
        except ConfigError as exc:
            raise pb.TritonModelException(f"config.pbtxt: {exc}") from None
        self.decoupled = pb.using_decoupled_model_transaction_policy(config)
        try:   # prefill_workers > 0: a frontend over worker processes (kiln.runtime.disagg), the same LLM API
            self.llm = disagg.llm(engine_dir, runtime, adapters)
        except (AdapterLoadError, ConfigError, EngineLoadError) as exc:
            raise pb.TritonModelException(f"kiln: {exc}") from None
        self.limits = EngineLimits(self.llm.engine.config.model.vocab_size, bounds.max_input_len, bounds.max_seq_len,
                                   PromptBounds.of(self.llm.tokenizer, bounds.max_input_len).max_text_bytes)
        self.workers = PromptWorkers(1, name="kiln-triton-prompt")
        self.block_size = bounds.tokens_per_block
        self.metrics = TritonMetrics(pb, args["model_name"], args["model_version"], args.get("model_instance_name", ""),
                                     disagg=disagg.enabled)
        self._lock = threading.Lock()
        self._live: dict[int, _Stream] = {}      # id(stream) -> stream, for cancellation checks and gauges
        self._waiting_first = 0                  # live streams without a token yet (the admission queue)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()   # set by finalize: no more metrics or cancellation round trips
        self._metrics_due = False            # a request arrived: the sender refreshes the gauges at once
        self._sender = threading.Thread(target=self._send_loop, name="kiln-triton-sender", daemon=True)
        self._sender.start()
        mode = "decoupled" if self.decoupled else "one response per request"
        if disagg.enabled:
            mode += f", {disagg.prefill_workers} prefill + {disagg.decode_workers} decode workers"
        pb.Logger.log_info(f"kiln: serving {engine_dir} ({mode}, {torch.get_num_threads()} torch threads); "
                           f"{self.llm.stats()['kv_cache']['plan']}")

    # ---- requests (Triton's thread) -------------------------------------------------------------------
    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            arrays = self._guarded(sender, lambda r=request: {t.name(): t.as_numpy() for t in r.inputs()})
            if arrays is None:
                continue
            size = request_bytes(arrays)
            if size < self.workers.inline_bytes:
                self._guarded(sender, self._admit, request, sender, arrays)
                continue
            try:
                self.workers.submit(self._guarded, sender, self._admit, request, sender, arrays, size=size)
            except Busy as exc:
                self.metrics.refused("overloaded")
                self._guarded(sender, self._refuse, sender, f"overloaded: {exc}", pb.TritonError.UNAVAILABLE)
        return None

    def _guarded(self, sender, fn, *args):
        """``fn(*args)``; an exception is a bug of ours: answer the request with it, keep serving the others."""
        try:
            return fn(*args)
        except Exception as exc:
            pb.Logger.log_error(f"kiln: request failed: {traceback.format_exc()}")
            try:
                self._refuse(sender, f"internal error: {type(exc).__name__}: {exc}", pb.TritonError.INTERNAL)
            except Exception:  # it was answered before the failure
                pass
            return None

    def _encode(self, text: str) -> list[int]:
        if self.llm.tokenizer is None:
            return self.llm.encode(text)[0]   # InvalidRequestError: text prompts need a tokenizer
        return tokenize(self.llm.tokenizer, text)

    @staticmethod
    def _parameters(request) -> dict:
        """The request's parameters (an HTTP /generate request's JSON fields that are not inputs land here)."""
        params = json.loads(request.parameters() or "{}")
        return params if isinstance(params, dict) else {}

    def _admit(self, request, sender, arrays: dict) -> None:
        try:
            check_envelope(arrays, self._parameters(request))
            parsed = parse_request(arrays, self.limits, self._encode, self.decoupled)
        except (BadRequest, InvalidRequestError) as exc:
            self.metrics.refused("invalid")
            return self._refuse(sender, str(exc), pb.TritonError.INVALID_ARG)
        prompt_text = parsed.prompt_text   # what a non-streaming text_output starts with, unless excluded
        echo_prompt = not (parsed.stream or parsed.exclude_input_in_output)
        if prompt_text is None and echo_prompt and self.llm.tokenizer is not None:
            prompt_text = self.llm.decode(parsed.prompt_token_ids)
        stream = _Stream(request, sender, parsed, prompt_text or "")
        with self._lock:
            if self.max_queue_size and self._waiting_first >= self.max_queue_size:
                overloaded = True
            else:
                overloaded = False
                self._waiting_first += 1
                self._live[id(stream)] = stream
                self._metrics_due = True
        if overloaded:
            self.metrics.refused("overloaded")
            return self._refuse(sender, f"overloaded: {self.max_queue_size} requests already wait for their first "
                                        "token (max_queue_size); retry later", pb.TritonError.UNAVAILABLE)
        try:
            stream.request_id = self.llm.submit(parsed.prompt_token_ids, parsed.params, priority=parsed.priority,
                                                callback=lambda out, s=stream: self._outbox.put((s, out)),
                                                lora=parsed.lora)
        except (InvalidRequestError, ExecutorClosedError) as exc:
            with self._lock:
                self._waiting_first -= 1
                del self._live[id(stream)]
            if isinstance(exc, InvalidRequestError):
                self.metrics.refused("invalid")
                return self._refuse(sender, f"invalid request: {exc}", pb.TritonError.INVALID_ARG)
            return self._refuse(sender, f"kiln is not serving: {exc}", pb.TritonError.UNAVAILABLE)

    @staticmethod
    def _refuse(sender, message: str, code) -> None:
        sender.send(pb.InferenceResponse(error=pb.TritonError(message, code)),
                    flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    # ---- responses (the sender thread) ----------------------------------------------------------------
    def _send_loop(self) -> None:
        next_cancel_check = next_stats = 0.0
        while self._send_queued():
            if self._stopping.is_set():
                continue   # each is a round trip to tritonserver, which is unloading the model and may not answer
            now = time.monotonic()
            if now >= next_cancel_check:
                next_cancel_check = now + CANCEL_CHECK_S
                self._check_cancelled()
            if now >= next_stats or self._metrics_due:   # a new request shows in flight within CANCEL_CHECK_S
                next_stats, self._metrics_due = now + STATS_PERIOD_S, False
                self._update_metrics()

    def _send_queued(self) -> bool:
        """Send the outputs queued now (waiting up to CANCEL_CHECK_S for the first); False once finalize stops it.
        A function of its own so that its locals go when it returns: as loop variables they kept the last finished
        request's Triton request and response sender alive until the next request came."""
        try:
            items = [self._outbox.get(timeout=CANCEL_CHECK_S)]
        except queue.Empty:
            return True
        try:
            while True:
                items.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        # outputs that queued up while the last responses were sent go out as one response per request
        pending: dict[int, tuple[_Stream, list[RequestOutput]]] = {}
        for item in items:
            if item is _STOP:
                break
            stream, out = item
            pending.setdefault(id(stream), (stream, []))[1].append(out)
        for stream, outs in pending.values():
            self._deliver(stream, outs)
        return not any(item is _STOP for item in items)

    def _deliver(self, stream: _Stream, outs: list[RequestOutput]) -> None:
        """Send what ``outs`` (one request's outputs, oldest first) add, in one response."""
        if stream.done:
            return
        out = outs[-1]
        final = out.finished
        if not stream.has_token and (out.token_ids or final):
            stream.has_token = True
            with self._lock:
                self._waiting_first -= 1
        if final:
            stream.done = True
            with self._lock:
                self._live.pop(id(stream), None)
            if out.finish_reason != "abort":
                self.metrics.finished(out)
        if stream.cancelled:
            if final:
                self._try_send(stream, pb.InferenceResponse(error=pb.TritonError(
                    "cancelled by the client", pb.TritonError.CANCELLED)), final=True)
            return
        if final and out.error:
            return self._try_send(stream, pb.InferenceResponse(error=pb.TritonError(
                f"kiln's step loop failed: {out.error}", pb.TritonError.INTERNAL)), final=True)
        if final and out.finish_reason == "abort":
            return self._try_send(stream, pb.InferenceResponse(error=pb.TritonError(
                "aborted: the model is shutting down", pb.TritonError.UNAVAILABLE)), final=True)
        if not (final or stream.parsed.stream):
            return
        delta = ([t for o in outs for t in o.delta_token_ids], "".join(o.delta_text for o in outs))
        tensors = response_tensors(out, stream.parsed, stream.prompt_text, self.block_size, delta)
        response = pb.InferenceResponse(output_tensors=[pb.Tensor(name, arr) for name, arr in tensors.items()])
        self._try_send(stream, response, final)

    def _try_send(self, stream: _Stream, response, final: bool) -> None:
        try:
            stream.sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        except Exception as exc:  # the client is gone: nothing more can reach it, so stop computing for it too
            if not stream.cancelled:
                pb.Logger.log_warn(f"kiln: could not send a response of {stream.request_id} ({exc}); aborting it")
                stream.cancelled = True
                if not final:
                    self.llm.abort(stream.request_id)

    def _check_cancelled(self) -> None:
        with self._lock:
            streams = [s for s in self._live.values() if s.request_id and not s.cancelled]
        for s in streams:
            if s.sender.is_cancelled():
                s.cancelled = True
                self.llm.abort(s.request_id)

    def _update_metrics(self) -> None:
        with self._lock:
            active = len(self._live)
            generating = sum(s.has_token for s in self._live.values())
        self.metrics.update(self.llm.stats(), active, generating, healthy=self.llm.executor.failure is None)

    # ---- shutdown -------------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Stop kiln (requests still in flight end with an UNAVAILABLE error), then the sender thread. Logged at
        both ends: when tritonserver's unload outlasts its exit timeout, the log tells whether this ran."""
        started = time.monotonic()
        pb.Logger.log_info("kiln: finalize: stopping the step loop")
        self._stopping.set()
        self.workers.shutdown()
        self.llm.shutdown()
        self._outbox.put(_STOP)
        self._sender.join(timeout=SENDER_JOIN_S)
        self.metrics.close()
        pb.Logger.log_info(f"kiln: finalize: done in {time.monotonic() - started:.2f} s"
                           + ("" if not self._sender.is_alive() else " (the sender thread did not stop)"))
