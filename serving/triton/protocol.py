"""Triton tensors <-> kiln requests: parse one request's input tensors, build one response's output tensors.

Pure numpy, no Triton import: the Python-backend model (model.py) feeds it the arrays of a
``pb_utils.InferenceRequest`` and wraps what it returns into ``pb_utils.Tensor``s.

Semantics follow TensorRT-LLM's Triton backend so its clients see the same behaviour:
- a request without ``top_k``/``top_p`` (or with both 0) decodes greedily; ``temperature`` 0 does too;
- ``end_id`` replaces the engine's EOS as the token that ends generation (-1: none);
- streaming responses carry only what is new; a non-streaming response carries the whole output, with the
  prompt in front unless ``exclude_input_in_output`` is true;
- empty strings in ``stop_words``/``bad_words`` are ignored (TensorRT-LLM's clients send ``[""]``);
- ``guided_decoding_guide_type`` + ``guided_decoding_guide`` constrain the output (TensorRT-LLM's guided
  decoding): ``json`` (any JSON object, no guide), ``json_schema``, ``regex``, ``ebnf_grammar``,
  ``structural_tag``; an invalid guide is refused when the request is submitted (INVALID_ARG).
- ``lora_task_id`` N selects the LoRA adapter loaded under the name "N" (kiln loads adapters by name at start,
  so the weights tensors TensorRT-LLM's clients send with a task's first request are not needed);
  ``lora_name`` selects one by name.

Cheap checks come first (``check_envelope``: the request's size and its parameters; then each prompt's size), so
that nothing large is tokenized or copied before it is known to fit the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from kiln.runtime import RequestOutput, SamplingParams
from kiln.serving.prompt_bounds import MAX_REQUEST_BYTES
from kiln.serving.triton.tensors import INPUT_SPECS

# Request parameters the model accepts. tritonserver consumes its own (sequence_*, priority, timeout, triton_*) and
# passes every other one on; the HTTP /generate endpoint turns each JSON field that is not an input into one (its
# request "id" too), so any other parameter is a field kiln does not know
KNOWN_PARAMETERS = frozenset({"id"})


class BadRequest(ValueError):
    """A request that cannot be served as sent; the message names the tensor and the rule."""


@dataclass(frozen=True)
class EngineLimits:
    """What the parser checks prompts against (from the engine's config.json; ``max_text_bytes`` from its
    tokenizer, kiln.serving.prompt_bounds: None when no byte bound is safe)."""

    vocab_size: int
    max_input_len: int
    max_seq_len: int
    max_text_bytes: int | None = None


def request_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """The size of a request's input tensors (BYTES elements by their length)."""
    total = 0
    for arr in arrays.values():
        if arr.dtype == np.object_:
            total += sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in arr.reshape(-1))
        else:
            total += arr.nbytes
    return total


def check_envelope(arrays: Mapping[str, np.ndarray], parameters: Mapping[str, object]) -> None:
    """BadRequest for a request over MAX_REQUEST_BYTES, or with parameters kiln does not know (an HTTP /generate
    request's unknown JSON fields arrive as parameters): the checks before anything else."""
    size = request_bytes(arrays)
    if size > MAX_REQUEST_BYTES:
        raise BadRequest(f"the request's inputs are {size} bytes, more than {MAX_REQUEST_BYTES >> 20} MiB; "
                         "send a smaller one")
    unknown = sorted(set(parameters) - KNOWN_PARAMETERS)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(map(repr, unknown))}: not an input of this model "
                         f"(its inputs: {', '.join(INPUT_SPECS)})")


@dataclass
class ParsedRequest:
    prompt_token_ids: list[int]
    prompt_text: str | None          # the text sent, when the prompt came as text_input
    params: SamplingParams
    priority: int
    stream: bool
    exclude_input_in_output: bool
    return_log_probs: bool
    lora: str | None = None          # the LoRA adapter's name (lora_name, or lora_task_id as a name)


# the array kinds each input's TensorRT-LLM type admits (any integer for an integer input: --int64-inputs
# declares them INT64, and each value is range-checked below as the number it is)
_KINDS = {"TYPE_STRING": "OSU", "TYPE_BOOL": "b", "TYPE_FP32": "f", "TYPE_INT32": "iu", "TYPE_UINT64": "iu"}


class _Inputs:
    """Typed access to one request's arrays (leading batch dimension of 1), errors naming the tensor."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = arrays

    def array(self, name: str) -> np.ndarray | None:
        arr = self.arrays.get(name)
        if arr is None:
            return None
        spec = INPUT_SPECS[name]
        if arr.dtype.kind not in _KINDS[spec.data_type]:
            raise BadRequest(f"{name} must be {spec.wire_type}, got {arr.dtype}")
        if arr.ndim == 0 or arr.shape[0] != 1:
            raise BadRequest(f"{name}: one sequence per request (batch dimension 1), got shape {list(arr.shape)}")
        return arr

    def scalar(self, name: str, default=None):
        arr = self.array(name)
        if arr is None:
            return default
        if arr.size != 1:
            raise BadRequest(f"{name} must hold one value (shape [1, 1]), got shape {list(arr.shape)}")
        value = arr.reshape(-1)[0]
        return value.item() if isinstance(value, np.generic) else value

    def number(self, name: str, default: float | None = None) -> float | None:
        value = self.scalar(name)
        if value is None:
            return default
        if not math.isfinite(value):
            raise BadRequest(f"{name} must be a finite number, got {value}")
        return float(value)

    def strings(self, name: str) -> list[str]:
        arr = self.array(name)
        if arr is None:
            return []
        return [_text(name, v) for v in arr.reshape(-1)]


def _text(name: str, value) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"{name} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _check_length(name: str, num_tokens: int, limits: EngineLimits) -> None:
    if num_tokens > limits.max_input_len:
        raise BadRequest(f"{name}: the prompt has {num_tokens} tokens, more than the engine's max_input_len "
                         f"{limits.max_input_len}; shorten it")


def parse_request(arrays: Mapping[str, np.ndarray], limits: EngineLimits,
                  encode: Callable[[str], list[int]], decoupled: bool) -> ParsedRequest:
    """The kiln request described by a Triton request's input arrays, or BadRequest."""
    x = _Inputs(arrays)

    # ---- prompt ----
    has_text, has_ids = "text_input" in arrays, "input_ids" in arrays
    if has_text == has_ids:
        raise BadRequest("give exactly one prompt: text_input (BYTES, shape [1, 1]) or input_ids (INT32, shape [1, N])"
                         + ("; both were sent" if has_text else "; neither was sent"))
    prompt_text = None
    if has_text:
        raw = x.scalar("text_input")
        size = len(raw) if isinstance(raw, (bytes, str)) else 0
        if limits.max_text_bytes is not None and size > limits.max_text_bytes:   # before decoding or tokenizing
            raise BadRequest(f"text_input: the prompt is {size} bytes, more than the engine's max_input_len "
                             f"({limits.max_input_len} tokens) can hold with its tokenizer (at most "
                             f"{limits.max_text_bytes} bytes); shorten it")
        prompt_text = _text("text_input", raw)
        if not prompt_text:
            raise BadRequest("text_input is empty; send at least one character")
        ids = list(encode(prompt_text))
    else:
        arr = x.array("input_ids").reshape(-1)
        n = x.scalar("input_lengths")
        if n is not None:
            if not 1 <= n <= len(arr):
                raise BadRequest(f"input_lengths must be in [1, {len(arr)}] (the number of input_ids), got {n}")
            arr = arr[:n]
        if not len(arr):
            raise BadRequest("input_ids is empty; send at least one token id")
        _check_length("input_ids", len(arr), limits)   # before its ids are read
        bad = arr[(arr < 0) | (arr >= limits.vocab_size)]
        if len(bad):
            raise BadRequest(f"input_ids {bad[:5].tolist()} are outside the vocabulary [0, {limits.vocab_size})")
        ids = arr.tolist()
    _check_length("text_input" if has_text else "input_ids", len(ids), limits)

    # ---- lengths ----
    max_tokens = x.scalar("max_tokens")
    if max_tokens is None:
        raise BadRequest("max_tokens is required: the number of tokens to generate (INT32, shape [1, 1])")
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}")
    if len(ids) + max_tokens > limits.max_seq_len:
        room = max(limits.max_seq_len - len(ids), 0)
        raise BadRequest(f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the engine's "
                         f"max_seq_len {limits.max_seq_len}; send max_tokens <= {room}")
    min_tokens = x.scalar("min_tokens", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise BadRequest(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")

    # ---- what kiln does not do ----
    for name in ("beam_width", "num_return_sequences"):
        value = x.scalar(name, 1)
        if value != 1:
            raise BadRequest(f"{name} must be 1 (kiln generates one sequence per request), got {value}")
    for name in ("return_context_logits", "return_generation_logits"):
        if x.scalar(name, False):
            raise BadRequest(f"{name} is not supported by kiln; send false or leave it out")
    if any(x.strings("bad_words")):
        raise BadRequest("bad_words is not supported by kiln (it does not mask word sequences); "
                         "leave it out or send \"\"")
    for name in ("pad_id", "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens"):
        x.scalar(name)  # accepted; checked for shape and type only

    # ---- sampling ----
    stream = bool(x.scalar("stream", False))
    if stream and not decoupled:
        raise BadRequest("stream=true needs a decoupled model; render the repository with --decoupled "
                         "(the default) or send stream=false")
    temperature = x.number("temperature", 1.0)
    top_k = x.scalar("top_k")
    top_p = x.number("top_p")
    if temperature < 0:
        raise BadRequest(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise BadRequest(f"top_k must be >= 0 (0 disables), got {top_k}")
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise BadRequest(f"top_p must be in [0, 1] (0 disables), got {top_p}")
    greedy = temperature == 0.0 or top_k == 1 or (not top_k and not top_p)
    end_id = x.scalar("end_id")
    stop_token_ids: list[int] = []
    ignore_eos = bool(x.scalar("ignore_eos", False))
    if end_id is not None:
        if end_id != -1 and not 0 <= end_id < limits.vocab_size:
            raise BadRequest(f"end_id must be a token id in [0, {limits.vocab_size}) or -1 (none), got {end_id}")
        ignore_eos = True  # end_id replaces the engine's EOS
        stop_token_ids = [end_id] if end_id != -1 else []
    stop = [s for s in x.strings("stop_words") if s]
    return_log_probs = bool(x.scalar("return_log_probs", False))
    structured = guided_decoding(x)
    try:
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=min_tokens,
            temperature=0.0 if greedy else temperature,
            top_k=top_k or 0, top_p=top_p or 1.0, min_p=x.number("min_p", 0.0),
            repetition_penalty=x.number("repetition_penalty", 1.0),
            presence_penalty=x.number("presence_penalty", 0.0), frequency_penalty=x.number("frequency_penalty", 0.0),
            seed=x.scalar("seed"), stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
            logprobs=0 if return_log_probs else None, structured_output=structured,
        )
    except ValueError as exc:
        raise BadRequest(str(exc).removeprefix("invalid SamplingParams: ")) from None
    return ParsedRequest(
        prompt_token_ids=ids, prompt_text=prompt_text, params=params, priority=int(x.scalar("priority", 0)),
        stream=stream, exclude_input_in_output=bool(x.scalar("exclude_input_in_output", False)),
        return_log_probs=return_log_probs, lora=_lora(x),
    )


# TensorRT-LLM's guide types -> the runtime's StructuredOutputParams field
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar",
               "structural_tag": "structural_tag"}


def guided_decoding(x: _Inputs) -> dict | None:
    """The structured_output of guided_decoding_guide_type / guided_decoding_guide (None when not sent)."""
    kind = x.scalar("guided_decoding_guide_type")
    guide = x.scalar("guided_decoding_guide")
    if kind is None:
        if guide is not None:
            raise BadRequest("guided_decoding_guide needs guided_decoding_guide_type (one of "
                             f"{', '.join(GUIDE_TYPES)})")
        return None
    kind = _text("guided_decoding_guide_type", kind)
    if kind not in GUIDE_TYPES:
        raise BadRequest(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}, got {kind!r}")
    if kind == "json":
        return {"json_object": True}
    guide = None if guide is None else _text("guided_decoding_guide", guide)
    if not guide:
        raise BadRequest(f"guided_decoding_guide_type {kind} needs guided_decoding_guide: the "
                         f"{kind.replace('_', ' ')} (text)")
    return {GUIDE_TYPES[kind]: guide}


def _lora(x: _Inputs) -> str | None:
    names = x.strings("lora_name")
    if len(names) > 1:
        raise BadRequest(f"lora_name must hold one adapter name (shape [1, 1]), got {len(names)}")
    name = names[0] if names and names[0] else None
    task = x.scalar("lora_task_id")
    if task is not None:
        if name is not None and name != str(task):
            raise BadRequest(f"lora_name {name!r} and lora_task_id {task} name different adapters; send one")
        name = str(task)
    return name


def _ns(t: float | None) -> int:
    return 0 if t is None else int(t * 1e9)


def response_tensors(out: RequestOutput, req: ParsedRequest, prompt_text: str, block_size: int,
                     delta: tuple[list[int], str] | None = None) -> dict[str, np.ndarray]:
    """Output arrays for one response: the new part when streaming (``delta``: token ids and text since the
    last response, default ``out``'s own delta), else the whole output (with the prompt in front unless
    excluded); the sequence-level outputs only on the last response. ``prompt_text`` is the prompt as text
    (the text sent, or the decode of input_ids)."""
    final = out.finished
    if req.stream:
        ids, text = delta if delta is not None else (out.delta_token_ids, out.delta_text)
    elif req.exclude_input_in_output:
        ids, text = out.token_ids, out.text
    else:
        ids, text = req.prompt_token_ids + out.token_ids, prompt_text + out.text
    tensors = {
        "text_output": np.array([[text.encode("utf-8")]], dtype=np.object_),
        "output_ids": np.array(ids, dtype=np.int32).reshape(1, 1, -1),
        "sequence_length": np.array([[len(ids)]], dtype=np.int32),
    }
    if req.return_log_probs:
        lps = [next(iter(d.values())) for d in (out.logprobs or [])]
        sent = lps[len(lps) - len(ids):] if req.stream else lps
        tensors["cum_log_probs"] = np.array([[sum(lps)]], dtype=np.float32)
        tensors["output_log_probs"] = np.array(sent, dtype=np.float32).reshape(1, 1, -1)
    if final:
        m = out.metrics
        n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
        held = -(-(n_prompt + max(n_out - 1, 0)) // block_size)   # the last token's KV is never written
        reused = m.num_cached_tokens // block_size
        tensors.update({
            "finish_reason": np.array([[out.finish_reason.encode()]], dtype=np.object_),
            "num_input_tokens": np.array([[n_prompt]], dtype=np.int32),
            "num_output_tokens": np.array([[n_out]], dtype=np.int32),
            "kv_cache_reused_blocks": np.array([[reused]], dtype=np.int32),
            "kv_cache_alloc_new_blocks": np.array([[held - reused]], dtype=np.int32),
            "kv_cache_alloc_total_blocks": np.array([[held]], dtype=np.int32),
            "arrival_time_ns": np.array([[_ns(m.arrival_time)]], dtype=np.int64),
            "first_scheduled_time_ns": np.array([[_ns(m.first_scheduled_time)]], dtype=np.int64),
            "first_token_time_ns": np.array([[_ns(m.first_token_time)]], dtype=np.int64),
            "last_token_time_ns": np.array([[_ns(m.last_token_time)]], dtype=np.int64),
        })
    return tensors
