"""Property test: arbitrary values in every SamplingParams field, every prompt shape and the priority, through
every entry point of one live LLM. Each request is either refused where it is given (a kiln ValueError:
ConfigError or InvalidRequestError) or completes without error; no KV block stays held after it; and after
all of them the LLM still returns transformers' greedy output. A fixed example budget, derandomized: the same
cases on every run."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.contract import ConfigError, InvalidRequestError
from kiln.runtime import LLM, SamplingParams

from runtime_support import ENTRY_POINTS, assert_no_leak, get_engine, run_via, still_serves

pytestmark = pytest.mark.xdist_group("fuzz")   # its own group: ~40 s beside the runtime tests, not after them

EXAMPLES = 1000
VOCAB = 512

HOSTILE = st.sampled_from([None, True, False, "x", "", b"ab", 1.5, 2.0, float("nan"), float("inf"), -float("inf"),
                           -1, 0, 2**64, 2**70, [1], [b"x"], [("x",)], ("x",), {}, {"a": 1}, object()])
PLAUSIBLE = {
    "max_tokens": st.integers(1, 12) | st.none(),
    "min_tokens": st.integers(0, 8),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(-1, 600),
    "top_p": st.floats(0, 1),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0, 3),
    "presence_penalty": st.floats(-2.2, 2.2),
    "frequency_penalty": st.floats(-2.2, 2.2),
    "seed": st.integers(-5, 2**65),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(-2, 600), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "logprobs": st.integers(-1, 600) | st.none(),
    "skip_special_tokens": st.booleans(),
    # valid and invalid constraints, some shared (their compiled grammars come from the cache)
    "structured_output": st.none() | st.sampled_from([
        {"regex": "[a-c]{1,4}"}, {"choice": ["yes", "no"]}, {"json": {"type": "integer", "minimum": 0, "maximum": 9}},
        {"json_object": True, "any_whitespace": True}, {"grammar": 'root ::= "x" [0-9]'},
        {"regex": "a("}, {"json": "{not json"}, {"json": {"type": "array", "uniqueItems": True}},
        {"grammar": "root ::= undefined_rule"}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"jsn": {}},
    ]),
}
assert set(PLAUSIBLE) == {f.name for f in dataclasses.fields(SamplingParams)}   # every field is thrown at


@st.composite
def sampling_fields(draw) -> dict:
    """Some fields with values from around their ranges (mostly in), and sometimes one of any type at all."""
    fields = draw(st.fixed_dictionaries({}, optional=PLAUSIBLE))
    if draw(st.integers(0, 2)) == 0:
        fields[draw(st.sampled_from(sorted(PLAUSIBLE)))] = draw(HOSTILE)
    return fields



TOKEN_LISTS = st.lists(st.integers(-3, VOCAB + 5), min_size=1, max_size=100)
PROMPTS = st.one_of(
    st.text(min_size=1, max_size=40),
    TOKEN_LISTS,
    TOKEN_LISTS.map(tuple),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30).map(np.array),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30).map(torch.tensor),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30).map(lambda xs: [np.int64(x) for x in xs]),
    st.lists(st.one_of(st.integers(0, VOCAB - 1), st.floats(), st.booleans(), st.text(max_size=2), st.none()),
             max_size=5),
    st.sampled_from(["a\ud800b", b"\x05\x06", 5, 1.5, None, {5, 6}, np.array([[5, 6]]), np.array([5.0, 6.0]),
                     torch.tensor([True]), [[5, 6]], "", []]),
)
PRIORITIES = st.one_of(st.integers(-5, 5), st.integers(-2**70, 2**70), HOSTILE)


@pytest.fixture(scope="module")
def llama(checkpoint_dir):
    ckpt = checkpoint_dir("llama")
    return ckpt, get_engine(ckpt)


def test_arbitrary_requests_are_refused_or_served(llama):
    ckpt, engine = llama
    seen: collections.Counter[str] = collections.Counter()
    with LLM(engine) as llm:
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(fields=sampling_fields(), prompt=PROMPTS, priority=PRIORITIES, how=st.sampled_from(ENTRY_POINTS))
        def one_request(fields, prompt, priority, how):
            try:
                params = SamplingParams(**fields)
            except ConfigError:
                seen["refused by SamplingParams"] += 1
                return
            try:
                out = run_via(llm, how, prompt, params, priority=priority)
            except (ConfigError, InvalidRequestError):
                seen["refused at submission"] += 1
                return
            assert out.finished and out.error is None and out.finish_reason in ("stop", "length"), out
            assert params.max_tokens is None or len(out.token_ids) <= params.max_tokens
            seen["served"] += 1
            assert_no_leak(llm)

        one_request()
        print(f"\n{EXAMPLES} hostile requests: {dict(seen)}")
        # the mix is fixed (derandomized) but what is served moves with the checks kiln gains (about 20% served,
        # 16% refused at submission on 2026-12-02): bounds that catch a fuzz that only refuses, or only serves
        assert seen["served"] >= EXAMPLES // 8 and seen["refused at submission"] >= EXAMPLES // 10
        assert llm.executor.failure is None
        still_serves(llm, ckpt)
