"""What a request may carry, checked where it is given (engine-free): every SamplingParams and ExecutorConfig
field's type and range, the accepted prompt types, and the stop-string hold-back of a stream."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.contract import ConfigError, EngineBounds, InvalidRequestError, option_names, reject_unknown_options
from kiln.runtime import LLM, ExecutorConfig, SamplingParams
from kiln.runtime.executor import resolve_serving_limits
from kiln.runtime.prompts import is_single_prompt, prompt_token_ids
from kiln.runtime.stopping import StopHold, stop_hold

NAN, INF = float("nan"), float("inf")

# field, bad value, words the message must hold (the field, then what it accepts)
BAD_SAMPLING = [
    ("seed", 2**70, "seed must be an integer in [0, 2**64)"),
    ("seed", 2**64, "seed must be an integer in [0, 2**64)"),
    ("seed", -1, "seed must be an integer in [0, 2**64)"),
    ("seed", 1.5, "seed must be an integer"),
    ("seed", 7.0, "seed must be an integer"),
    ("seed", "7", "seed must be an integer"),
    ("seed", True, "seed must be an integer"),
    ("max_tokens", 2.0, "max_tokens must be an integer >= 1 or None"),
    ("max_tokens", 2.5, "max_tokens must be an integer"),
    ("max_tokens", "16", "max_tokens must be an integer"),
    ("max_tokens", False, "max_tokens must be an integer"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0"),
    ("min_tokens", None, "min_tokens must be an integer"),
    ("top_k", 1.5, "top_k must be an integer >= -1"),
    ("top_k", -2, "top_k must be an integer >= -1"),
    ("logprobs", -1, "logprobs must be an integer >= 0 or None"),
    ("logprobs", 1.0, "logprobs must be an integer"),
    ("temperature", NAN, "temperature must be a finite number >= 0"),
    ("temperature", INF, "temperature must be a finite number >= 0"),
    ("temperature", -0.5, "temperature must be a finite number >= 0"),
    ("temperature", "0.7", "temperature must be a finite number"),
    ("temperature", True, "temperature must be a finite number"),
    ("temperature", None, "temperature must be a finite number"),
    ("top_p", NAN, "top_p must be a finite number in (0, 1]"),
    ("top_p", 0.0, "top_p must be a finite number in (0, 1]"),
    ("top_p", 1.5, "top_p must be a finite number in (0, 1]"),
    ("min_p", -INF, "min_p must be a finite number in [0, 1]"),
    ("repetition_penalty", 0, "repetition_penalty must be a finite number > 0"),
    ("repetition_penalty", INF, "repetition_penalty must be a finite number > 0"),
    ("presence_penalty", NAN, "presence_penalty must be a finite number in [-2, 2]"),
    ("frequency_penalty", 2.5, "frequency_penalty must be a finite number in [-2, 2]"),
    ("stop", [b"ab"], "stop must be a string or a list of strings, got [b'ab']"),
    ("stop", [("x",)], "stop must be a string or a list of strings"),
    ("stop", b"ab", "stop must be a string or a list of strings"),
    ("stop", 5, "stop must be a string or a list of strings"),
    ("stop", [""], "stop strings must be non-empty"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of integers >= 0"),
    ("stop_token_ids", [1.5], "stop_token_ids must be a list of integers >= 0"),
    ("stop_token_ids", [True], "stop_token_ids must be a list of integers >= 0"),
    ("stop_token_ids", ["3"], "stop_token_ids must be a list of integers >= 0"),
    ("stop_token_ids", [-1], "stop_token_ids must be a list of integers >= 0"),
    ("ignore_eos", 1, "ignore_eos must be True or False"),
    ("include_stop_str_in_output", "yes", "include_stop_str_in_output must be True or False"),
    ("skip_special_tokens", None, "skip_special_tokens must be True or False"),
]


@pytest.mark.parametrize("name, value, message", BAD_SAMPLING)
def test_each_sampling_field_is_checked_at_construction(name, value, message):
    with pytest.raises(ConfigError) as exc:
        SamplingParams(**{name: value})
    assert str(exc.value).startswith("invalid SamplingParams: ") and message in str(exc.value), str(exc.value)


def test_every_problem_is_listed_and_good_values_are_normalised():
    with pytest.raises(ConfigError, match=r"top_p .*; seed .*; stop must"):
        SamplingParams(seed=-5, top_p=2.0, stop=[1])
    with pytest.raises(ConfigError, match=r"min_tokens \(5\) must not exceed max_tokens \(2\)"):
        SamplingParams(min_tokens=5, max_tokens=2)
    sp = SamplingParams(max_tokens=np.int64(4), temperature=1, top_k=-1, seed=2**64 - 1, stop="x",
                        stop_token_ids=(np.int32(7), 9), top_p=np.float32(0.5), ignore_eos=np.bool_(True))
    assert type(sp.max_tokens) is int and sp.max_tokens == 4
    assert type(sp.temperature) is float and sp.top_k == 0 and sp.seed == 2**64 - 1
    assert sp.stop == ["x"] and sp.stop_token_ids == [7, 9] and all(type(t) is int for t in sp.stop_token_ids)
    assert type(sp.top_p) is float and sp.ignore_eos is True
    sp.check()  # a constructed SamplingParams re-checks clean (the executor does so at submission)
    sp.seed = 2**70   # changed after construction: the re-check at submission catches it
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
        sp.check()


BAD_EXECUTOR = [
    ("max_batch_size", 0, "max_batch_size must be an integer >= 1 or None"),
    ("max_batch_size", 4.0, "max_batch_size must be an integer"),
    ("max_num_tokens", "64", "max_num_tokens must be an integer"),
    ("kv_cache_memory_fraction", NAN, "kv_cache_memory_fraction must be a finite number in (0, 1] or None"),
    ("kv_cache_memory_fraction", 0, "kv_cache_memory_fraction must be a finite number in (0, 1]"),
    ("max_kv_cache_tokens", True, "max_kv_cache_tokens must be an integer"),
    ("capacity_policy", "fastest", "capacity_policy must be one of"),
    ("enable_prefix_reuse", "no", "enable_prefix_reuse must be True or False"),
    ("seed", 2**64, "seed must be an integer in [0, 2**64)"),
    ("metrics_window", 0, "metrics_window must be an integer >= 1"),
    ("batch_min_share", 0, "batch_min_share must be a finite number in (0, 1]"),
    ("decoding_max_num_tokens", 0, "decoding_max_num_tokens must be an integer >= 1 or None"),
    ("short_prompt_lead_s", -1.0, "short_prompt_lead_s must be a finite number in [0, 3600]"),
]


@pytest.mark.parametrize("name, value, message", BAD_EXECUTOR)
def test_each_executor_option_is_checked(name, value, message):
    with pytest.raises(ConfigError) as exc:
        ExecutorConfig(**{name: value})
    assert message in str(exc.value), str(exc.value)


def test_batch_floor_above_its_ceiling_is_refused():
    with pytest.raises(ConfigError, match=r"batch_min_share 0.5 is above batch_max_share 0.25; lower the floor"):
        ExecutorConfig(batch_max_share=0.25, batch_min_share=0.5)


def test_decoding_budget_must_leave_a_full_batch_of_decodes_room_for_a_chunk():
    bounds = EngineBounds(max_batch_size=8, max_num_tokens=64, max_input_len=120, max_seq_len=128,
                          tokens_per_block=16, max_num_logits=8, max_blocks_per_seq=8)
    with pytest.raises(ConfigError, match=r"decoding_max_num_tokens=20 leaves .* at least max_batch_size - 1 \+ "
                                          r"tokens_per_block = 23"):
        resolve_serving_limits(bounds, 64, ExecutorConfig(decoding_max_num_tokens=20, kv_cache_memory_fraction=None,
                                                          max_kv_cache_tokens=1024))
    ok = resolve_serving_limits(bounds, 64, ExecutorConfig(decoding_max_num_tokens=23, kv_cache_memory_fraction=None,
                                                           max_kv_cache_tokens=1024))
    assert ok.decoding_max_num_tokens == 23
    # at or above the step budget it changes nothing
    assert resolve_serving_limits(bounds, 64, ExecutorConfig(decoding_max_num_tokens=64, kv_cache_memory_fraction=None,
                                                             max_kv_cache_tokens=1024)).decoding_max_num_tokens is None


# ---- prompts ---------------------------------------------------------------------------------------------
ACCEPTED = [
    [5, 6, 7], (5, 6, 7), range(5, 8), [np.int64(5), np.int32(6), np.uint8(7)], np.array([5, 6, 7]),
    np.array([5, 6, 7], dtype=np.uint16), torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7], dtype=torch.int32),
    [torch.tensor(5), torch.tensor(6), torch.tensor(7)],
]


@pytest.mark.parametrize("prompt", ACCEPTED, ids=lambda p: type(p).__name__)
def test_accepted_token_prompts_become_the_same_ints(prompt):
    ids = prompt_token_ids(prompt)
    assert ids == [5, 6, 7] and all(type(t) is int for t in ids)
    assert is_single_prompt(prompt)


REFUSED = [
    ([1.5, 2.7], "got float at index 0 (1.5)"),
    ([5, 6.0], "got float at index 1 (6.0)"),
    (["5", "6"], "got str at index 0 ('5')"),
    ([True, False], "got bool at index 0 (True)"),
    ([[5, 6]], "got list at index 0"),
    ([5, None], "got NoneType at index 1"),
    (b"abc", "got bytes"),
    (bytearray(b"abc"), "got bytearray"),
    ({5, 6}, "got set"),
    ({5: 6}, "got dict"),
    (5, "got int"),
    (None, "got NoneType"),
    (iter([5, 6]), "got list_iterator"),
    (np.array([1.5, 2.0]), "got a numpy array of float64"),
    (np.array([True, False]), "got a numpy array of bool"),
    (np.array([[5, 6]]), "got a 2-D numpy array"),
    (np.array(5), "got a 0-D numpy array"),
    (torch.tensor([1.0, 2.0]), "got a torch tensor of torch.float32"),
    (torch.tensor([[5, 6]]), "got a 2-D torch tensor"),
    ([torch.tensor(1.5)], "got Tensor at index 0"),
    ([np.float32(5)], "got float32 at index 0"),
]


@pytest.mark.parametrize("prompt, message", REFUSED, ids=lambda p: type(p).__name__)
def test_refused_prompts_name_their_type(prompt, message):
    with pytest.raises(InvalidRequestError) as exc:
        prompt_token_ids(prompt)
    assert message in str(exc.value), str(exc.value)


def test_single_prompt_or_batch():
    assert is_single_prompt("text") and is_single_prompt([5]) and is_single_prompt(np.array([5]))
    assert is_single_prompt([1.5]) and is_single_prompt([True])   # a single prompt, refused when checked
    assert not is_single_prompt(["a", "b"]) and not is_single_prompt([[5], [6]]) and not is_single_prompt([])
    assert not is_single_prompt([np.array([5]), torch.tensor([6])])
    with pytest.raises(InvalidRequestError, match="2-D numpy array is not a prompt; pass a list of prompts"):
        is_single_prompt(np.array([[5, 6], [7, 8]]))


# ---- stop strings ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, stops, held", [
    ("hello world", ["<|end|>"], 0),          # nothing that could start the stop string: release it all
    ("hello <|en", ["<|end|>"], 4),           # "<|en" may become "<|end|>"
    ("hello <", ["<|end|>", "STOP"], 1),
    ("hello ST", ["<|end|>", "STOP"], 2),
    ("aaa", ["aab"], 2),                      # the longest suffix that is a prefix of some stop string
    ("x" * 100, ["\x00" * 40], 0),            # a long stop string holds nothing back by itself
    ("abc", [], 0),
])
def test_stream_holds_back_only_what_could_start_a_stop_string(text, stops, held):
    assert stop_hold(text, stops) == held


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.text("ab", min_size=1, max_size=6), max_size=3), st.text("abc", max_size=12), st.data())
def test_stop_hold_fed_in_pieces_is_the_longest_suffix_that_starts_a_stop_string(stops, text, data):
    want = max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)
    hold = StopHold(stops)
    cut = data.draw(st.integers(0, len(text)))
    hold.feed(text[:cut])
    hold.feed(text[cut:])
    assert hold.held == stop_hold(text, stops) == want


@pytest.mark.parametrize("make, owner, typo, meant", [
    (lambda: SamplingParams(max_tokes=4), "SamplingParams", "max_tokes", "max_tokens"),
    (lambda: SamplingParams(temprature=0), "SamplingParams", "temprature", "temperature"),
    (lambda: ExecutorConfig(max_batch_sise=4), "ExecutorConfig", "max_batch_sise", "max_batch_size"),
    (lambda: LLM("no-such-engine", max_batch_sise=4), "LLM", "max_batch_sise", "max_batch_size"),
    (lambda: LLM("no-such-engine", tokeniser=None), "LLM", "tokeniser", "tokenizer"),
])
def test_unknown_options_name_the_closest_valid_one(make, owner, typo, meant):
    """A typo is a ConfigError (not the dataclass's TypeError) naming it, the closest option and the list; LLM
    checks its options before it loads anything."""
    with pytest.raises(ConfigError) as exc:
        make()
    msg = str(exc.value)
    assert msg.startswith(f"{owner}: unknown option {typo!r} (did you mean {meant!r}?); valid options: "), msg
    valid = msg.split("valid options: ")[1].split(", ")
    cls = {"SamplingParams": SamplingParams, "ExecutorConfig": ExecutorConfig}.get(owner, ExecutorConfig)
    assert set(option_names(cls)) <= set(valid)
    if owner == "LLM":
        assert {"tokenizer", "config"} <= set(valid)


def test_option_names_follow_the_dataclass_fields():
    """The valid names are read from the fields, so a field added to a dataclass is accepted and suggested."""

    @reject_unknown_options()
    @dataclasses.dataclass
    class Options:
        speculative_config: dict | None = None

    assert Options(speculative_config={"k": 2}).speculative_config == {"k": 2}
    with pytest.raises(ConfigError, match="did you mean 'speculative_config'"):
        Options(speculative_conifg={})
    with pytest.raises(TypeError):   # positional misuse stays the interpreter's error
        Options(1, 2)
