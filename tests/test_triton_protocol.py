"""The Triton model's request parser (kiln.serving.triton.protocol) without a server: any tensors of the declared
types, with values at and beyond the ends of their widths, give a request within the engine's bounds or a
BadRequest naming the tensor, never another exception (which the model would answer as an internal error); the
checks before anything else (the request's size, unknown parameters) come first."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.serving.prompt_bounds import MAX_REQUEST_BYTES, PromptBounds, tokenize
from kiln.serving.triton.protocol import BadRequest, EngineLimits, check_envelope, parse_request, request_bytes
from kiln.serving.triton.tensors import INPUT_SPECS

from synthetic_checkpoints import train_tokenizer

TOKENIZER = train_tokenizer(512)
LIMITS = EngineLimits(512, 96, 128, PromptBounds.of(TOKENIZER, 96).max_text_bytes)
WIDTH = {"TYPE_INT32": np.int32, "TYPE_UINT64": np.uint64, "TYPE_FP32": np.float32, "TYPE_BOOL": np.bool_}


def encode(text: str) -> list[int]:
    return tokenize(TOKENIZER, text)


def ends(dtype) -> st.SearchStrategy:
    """Values of ``dtype`` with its extremes, 0, +-1 and small ones well represented."""
    if dtype is np.bool_:
        return st.booleans()
    if dtype is np.float32:
        return st.floats(width=32) | st.sampled_from([0.0, -0.0, 1.0, float("nan"), float("inf"), -1e38])
    info = np.iinfo(dtype)
    return st.sampled_from([int(info.min), int(info.max), 0, 1, -1 if info.min < 0 else 2]) | st.integers(
        int(info.min), int(info.max)) | st.integers(-3, 600).filter(lambda v: info.min <= v <= info.max)


@st.composite
def tensors(draw) -> dict[str, np.ndarray]:
    names = draw(st.sets(st.sampled_from(sorted(INPUT_SPECS)), max_size=6))
    names |= {draw(st.sampled_from(["text_input", "input_ids"]))}
    arrays = {}
    if draw(st.integers(0, 9)):   # mostly a max_tokens that fits, so that the rest of the request gets parsed
        names.discard("max_tokens")
        arrays["max_tokens"] = np.array([[draw(st.integers(1, 16))]], dtype=np.int32)
    for name in names:
        spec = INPUT_SPECS[name]
        count = draw(st.integers(1, 4)) if spec.dims == (-1,) else 1
        if spec.data_type == "TYPE_STRING":
            values = [draw(st.binary(max_size=40) | st.text(max_size=40).map(str.encode)) for _ in range(count)]
            arrays[name] = np.array([values], dtype=np.object_)
        else:
            dtype = WIDTH[spec.data_type]
            arrays[name] = np.array([[draw(ends(dtype)) for _ in range(count)]], dtype=dtype)
    return arrays


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays=tensors(), decoupled=st.booleans())
def test_any_typed_tensors_give_a_bounded_request_or_a_bad_request(arrays, decoupled):
    try:
        parsed = parse_request(arrays, LIMITS, encode, decoupled)
    except BadRequest as exc:
        assert str(exc)
        return
    p = parsed.params
    assert 1 <= len(parsed.prompt_token_ids) <= LIMITS.max_input_len
    assert all(0 <= t < LIMITS.vocab_size for t in parsed.prompt_token_ids)
    assert 1 <= p.max_tokens and len(parsed.prompt_token_ids) + p.max_tokens <= LIMITS.max_seq_len
    assert 0 <= p.min_tokens <= p.max_tokens
    assert p.seed is None or 0 <= p.seed < 2**64
    assert all(0 <= t < LIMITS.vocab_size for t in p.stop_token_ids)
    assert np.iinfo(np.int32).min <= parsed.priority <= np.iinfo(np.int32).max


def test_checks_before_anything_else():
    text = np.array([[b"x" * (MAX_REQUEST_BYTES + 1)]], dtype=np.object_)
    assert request_bytes({"text_input": text, "max_tokens": np.array([[4]], dtype=np.int32)}) == MAX_REQUEST_BYTES + 5
    with pytest.raises(BadRequest, match="more than 16 MiB"):
        check_envelope({"text_input": text}, {})
    with pytest.raises(BadRequest, match=r"unknown field\(s\) 'foo', 'zed': not an input of this model"):
        check_envelope({}, {"zed": 1, "foo": True, "id": "r-1"})
    check_envelope({}, {"id": "r-1"})   # the request id /generate passes on is not unknown
    # a text over the byte bound is refused by its size, and ids past max_input_len by their number
    never = [].__getitem__   # the prompt must not be tokenized
    over = np.array([[b"x" * (LIMITS.max_text_bytes + 1)]], dtype=np.object_)
    with pytest.raises(BadRequest, match=f"at most {LIMITS.max_text_bytes} bytes"):
        parse_request({"text_input": over, "max_tokens": np.array([[4]], dtype=np.int32)}, LIMITS, never, True)
    ids = np.full((1, 4_000_000), 10**9, dtype=np.int32)   # also outside the vocabulary: length is checked first
    with pytest.raises(BadRequest, match="4000000 tokens, more than the engine's max_input_len 96"):
        parse_request({"input_ids": ids, "max_tokens": np.array([[4]], dtype=np.int32)}, LIMITS, never, True)
