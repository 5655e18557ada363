"""Structured output without an engine: the constraint's checks, the vocabulary xgrammar sees (against
xgrammar's own reading of the same tokenizer through transformers), parse errors at submission, the
matcher, the compile cache and its thread pool, and the sampler's masked rows."""

from __future__ import annotations

import json
import os
import re
import threading

import pytest
import torch

from kiln.contract import ConfigError, InvalidRequestError
from kiln.runtime.grammar import GrammarCompiler, GrammarMasks, parse_grammar, tokenizer_info, vocabulary_metadata
from kiln.runtime.metrics import RuntimeMetrics
from kiln.runtime.request import Request
from kiln.runtime.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.structured_output import StructuredOutputParams

from synthetic_checkpoints import train_tokenizer

xgr = pytest.importorskip("xgrammar")
VOCAB = 512
EOS = 2


@pytest.fixture(scope="module", params=["bpe", "sentencepiece"])
def tokenizer(request):
    return train_tokenizer(VOCAB, request.param)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, [EOS], RuntimeMetrics(), cache_size=4)
    yield c
    c.close()


def compiled(compiler: GrammarCompiler, **spec):
    return compiler.prepare(StructuredOutputParams(**spec)).result(timeout=60)


def allowed(grammar, vocab: int = VOCAB) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    grammar.fill(bitmask, 0)
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def feed(grammar, text: str) -> None:
    """Advance a matcher by text (the tokens a model would pick depend on the tokenizer; the state does not)."""
    assert grammar.matcher.accept_string(text), text


def token(tokenizer, text: str) -> int:
    """The id of the single token spelling ``text`` (no prefix space), in either tokenizer."""
    t = tokenizer.token_to_id(text)
    assert t is not None, text
    return t


# ---- the constraint -----------------------------------------------------------------------------------------
def test_exactly_one_constraint_of_the_right_type():
    assert StructuredOutputParams(regex="a+").kind == "regex"
    assert SamplingParams(structured_output={"choice": ["x", "y"]}).structured_output.choice == ["x", "y"]
    bad = [dict(), dict(regex="a", choice=["b"]), dict(json=5), dict(regex=""), dict(choice=[]), dict(choice=["a", ""]),
           dict(json_object="yes"), dict(json={"x": object()}), dict(grammar=b"root")]
    for spec in bad:
        with pytest.raises(ConfigError, match="invalid structured_output"):
            StructuredOutputParams(**spec)
    with pytest.raises(ConfigError, match="unknown keys \\['jsn'\\]"):
        SamplingParams(structured_output={"jsn": {}})
    with pytest.raises(ConfigError, match="must be a StructuredOutputParams"):
        SamplingParams(structured_output="[0-9]+")
    with pytest.raises(ConfigError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=3, structured_output={"regex": "a+"})


def test_cache_key_is_canonical():
    a = StructuredOutputParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert a.cache_key == b.cache_key
    assert a.cache_key != StructuredOutputParams(json=a.json, any_whitespace=True).cache_key
    assert StructuredOutputParams(regex="a", any_whitespace=True).cache_key == ("regex", "a", False)


# ---- the vocabulary ------------------------------------------------------------------------------------------
def test_vocabulary_reads_like_xgrammar_reads_the_hf_tokenizer(tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")
    reference = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[EOS])
    ours = tokenizer_info(tokenizer, VOCAB, [EOS])
    assert vocabulary_metadata(tokenizer) == (reference.vocab_type.name, reference.add_prefix_space)
    specials = {0, 1, 2}
    assert set(ours.special_token_ids) == specials - {EOS}   # blanked; EOS is a stop token
    for i, (a, b) in enumerate(zip(ours.decoded_vocab, reference.decoded_vocab)):
        assert i in specials or a == b, (i, a, b)


def test_padded_model_vocabulary_never_allows_the_padding(tokenizer):
    info = tokenizer_info(tokenizer, VOCAB + 30, [EOS])
    assert set(range(VOCAB, VOCAB + 30)) <= set(info.special_token_ids)
    c = GrammarCompiler(tokenizer, VOCAB + 30, [EOS], RuntimeMetrics())
    try:
        g = c.matcher(compiled(c, json_object=True), [])
        feed(g, '{"')
        ok = allowed(g, VOCAB + 30)
        assert ok and max(ok) < VOCAB and not ok & {0, 1, 2}   # inside a string: no special token, no padding
    finally:
        c.close()


# ---- parsing -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    (dict(json="{not json"), "structured_output.json is not valid JSON"),
    (dict(json='"a"'), "must be a JSON schema"),
    (dict(json={"type": "objec"}), "invalid JSON schema in structured_output.json: Unsupported type \"objec\""),
    (dict(json={"type": "string", "minLength": 5, "maxLength": 2}), "minLength 5 is greater than maxLength 2"),
    (dict(json={"type": "array", "uniqueItems": True}), "'uniqueItems' at #"),
    (dict(json={"properties": {"not": {"not": {"type": "string"}}}}), "'not' at #/properties/not"),
    (dict(json={"allOf": [{"type": "object"}, {"required": ["a"]}]}), "'allOf' with 2 subschemas"),
    (dict(json={"items": {"type": "string", "pattern": "[a-z]+", "maxLength": 3}}), "at #/items"),
    (dict(json={"type": "array", "contains": {"const": 1}}), "'contains' at #"),
    (dict(regex="a(b"), "invalid regex in structured_output.regex: Regex parsing error at position 4"),
    (dict(regex="(?=a)b"), "uses '(?='"),
    (dict(regex=r"(a)\1"), "a backreference"),
    (dict(grammar='root ::= "a" | b'), 'Rule "b" is not defined'),
    (dict(grammar='start ::= "a"'), "invalid EBNF grammar"),
    (dict(structural_tag="{"), "structured_output.structural_tag is not valid JSON"),
    (dict(structural_tag={"structures": "x", "triggers": []}), "the legacy form takes"),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}), "invalid structural tag"),
])
def test_invalid_constraints_name_the_problem(spec, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        parse_grammar(StructuredOutputParams(**spec))


def test_choices_match_exactly_whatever_they_contain(compiler, tokenizer):
    choices = ['say "hi"', "back\\slash", "two\nlines", "café", "a"]
    spec = dict(choice=choices)
    for c in choices:
        g = compiler.matcher(compiled(compiler, **spec), [])
        feed(g, c)
        assert allowed(g) >= {EOS}
        assert g.accept(EOS) and g.terminated
    g = compiler.matcher(compiled(compiler, **spec), [])
    assert not g.accept(token(tokenizer, "z")) and not g.matcher.accept_string("sz")


def test_json_strings_with_a_length_never_take_control_characters(compiler, tokenizer):
    g = compiler.matcher(compiled(compiler, json={"type": "string", "maxLength": 8}), [])
    feed(g, '"')
    ok = allowed(g)
    decoded = compiler.info.decoded_vocab
    assert ok and not [t for t in ok if any(b < 0x20 for b in decoded[t])]
    assert token(tokenizer, '"') in ok


# ---- the matcher ---------------------------------------------------------------------------------------------
def test_matcher_accepts_rolls_back_and_ends_only_on_a_stop_token(compiler, tokenizer):
    g = compiler.matcher(compiled(compiler, json={"type": "integer", "minimum": 0, "maximum": 99}), [7])
    assert g.accept(token(tokenizer, "4"))
    assert {EOS, 7} <= allowed(g)                      # the request's stop token id ends it too
    assert not g.accept(token(tokenizer, "}"))         # refused, state unchanged
    assert g.accept(token(tokenizer, "2"))
    assert allowed(g) == {EOS, 7}                      # 42: nothing but a stop token may follow
    assert g.accept(7) and g.terminated
    g.rollback(2)
    assert not g.terminated and g.num_accepted == 1
    with pytest.raises(ValueError, match="cannot roll back 2 tokens: 1 were accepted"):
        g.rollback(2)
    assert g.accept(token(tokenizer, "7")) and g.accept(EOS) and g.terminated


# ---- the compiler ----------------------------------------------------------------------------------------------
def test_cache_counts_claims_and_evicts_the_least_recently_used(tokenizer):
    m = RuntimeMetrics()
    c = GrammarCompiler(tokenizer, VOCAB, [EOS], m, cache_size=2)
    try:
        specs = [StructuredOutputParams(regex=r) for r in ("a+", "b+", "c+")]
        first = c.prepare(specs[0])                     # validation: compiles, counts nothing
        assert c.claim(specs[0]) is first               # the first request to use it: a miss
        assert c.claim(specs[0]) is first               # the next one: a hit
        futures = [first, c.claim(specs[1]), c.claim(specs[2])]   # c+ evicts a+ (cache_size 2)
        futures.append(c.claim(specs[0]))
        assert futures[-1] is not first
        assert (m.counters["grammar_cache_hits"], m.counters["grammar_cache_misses"]) == (1, 4)
        for f in futures:
            f.result(timeout=60)
        assert m.hist["grammar_compile_time"].count == 4
        if hasattr(os, "SCHED_IDLE"):   # the pool's threads run on what the step loop leaves idle
            policy = c._pool.submit(lambda: os.sched_getscheduler(threading.get_native_id()))
            assert policy.result() == os.SCHED_IDLE and os.sched_getscheduler(0) != os.SCHED_IDLE
    finally:
        c.close()


# ---- the sampler ---------------------------------------------------------------------------------------------
def test_sampler_masks_constrained_rows_only(compiler, tokenizer):
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 5
    spec = {"regex": "[0-9]"}
    decoded = compiler.info.decoded_vocab   # a digit, or its byte-fallback token <0x3N>
    digits = {t for t in range(VOCAB) if re.fullmatch(rb"[0-9]", decoded[t])}
    rows = [SamplingParams(temperature=0, structured_output=spec, logprobs=25), SamplingParams(temperature=0),
            SamplingParams(temperature=1.0, seed=3, structured_output=spec), SamplingParams(temperature=1.0, seed=4)]
    reqs = [Request(f"r{i}", [3, 4], p, 8, eos_token_ids=(EOS,)) for i, p in enumerate(rows)]
    for i in (0, 2):
        reqs[i].grammar = compiler.matcher(compiled(compiler, **spec), [])
    alone = [Request(f"u{i}", [3, 4], rows[i], 8, eos_token_ids=(EOS,)) for i in (1, 3)]
    reference = Sampler(VOCAB, seed=1)(logits[[1, 3]].clone(), alone)
    out = Sampler(VOCAB, seed=1)(logits.clone(), reqs)
    assert out.token_ids[0] in digits and out.token_ids[2] in digits
    assert out.token_ids[0] == max(digits, key=lambda t: logits[0, t])   # greedy among the allowed
    assert [out.token_ids[1], out.token_ids[3]] == reference.token_ids   # unconstrained rows as without the others
    assert out.mask_time is not None and reference.mask_time is None
    lp = out.logprobs[0]   # top-25 asked, only digits allowed: no -inf entries, and they sum to 1
    assert set(lp) == digits and abs(sum(torch.tensor(list(lp.values())).exp()) - 1) < 1e-4


def test_grammar_masks_grow_with_the_batch(compiler, tokenizer):
    masks = GrammarMasks(VOCAB)
    spec = {"choice": ["ab", "cd"]}
    for batch in (1, 3):
        reqs = [Request(f"r{i}", [3], SamplingParams(structured_output=spec), 4) for i in range(batch)]
        for r in reqs:
            r.grammar = compiler.matcher(compiled(compiler, **spec), [])
        out = masks.apply(torch.zeros(batch, VOCAB), reqs)
        for row in out:
            ok = {t for t in range(VOCAB) if row[t] == 0}
            decoded = [compiler.info.decoded_vocab[t] for t in ok]
            assert ok and all(re.fullmatch(rb"[\xe2\x96\x81 ]?(a|ab|c|cd)", d) for d in decoded), decoded


def test_json_schema_outputs_of_the_grammar_validate(compiler, tokenizer):
    """A hand-walked output: the grammar takes a valid document token by token and then ends."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "t": {"type": "array", "maxItems": 2,
                                                                                "items": {"enum": ["x", "y"]}}},
              "required": ["n", "t"], "additionalProperties": False}
    doc = {"n": 3, "t": ["y"]}
    g = compiler.matcher(compiled(compiler, json=schema), [])
    feed(g, json.dumps(doc))
    assert g.accept(EOS) and g.terminated
    jsonschema.validate(doc, schema)


# ---- Triton's guided decoding inputs ------------------------------------------------------------------------
def test_triton_guided_decoding_inputs():
    import numpy as np

    from kiln.serving.triton.protocol import BadRequest, EngineLimits, parse_request

    def text(value: str) -> np.ndarray:
        return np.array([[value.encode()]], dtype=np.object_)

    def parse(**extra):
        arrays = {"text_input": text("hi"), "max_tokens": np.array([[8]], dtype=np.int32)}
        arrays.update({k: text(v) if isinstance(v, str) else v for k, v in extra.items()})
        return parse_request(arrays, EngineLimits(VOCAB, 96, 128), lambda s: [5, 6], True).params.structured_output

    assert parse() is None
    assert parse(guided_decoding_guide_type="json").json_object
    assert parse(guided_decoding_guide_type="json_schema", guided_decoding_guide='{"type": "integer"}').json == \
        '{"type": "integer"}'
    assert parse(guided_decoding_guide_type="regex", guided_decoding_guide="[0-9]+").regex == "[0-9]+"
    assert parse(guided_decoding_guide_type="ebnf_grammar", guided_decoding_guide='root ::= "a"').grammar
    assert parse(guided_decoding_guide_type="structural_tag", guided_decoding_guide="{}").structural_tag == "{}"
    for extra, message in [(dict(guided_decoding_guide_type="xml"), "must be one of json, json_schema"),
                           (dict(guided_decoding_guide="[0-9]"), "needs guided_decoding_guide_type"),
                           (dict(guided_decoding_guide_type="regex"), "needs guided_decoding_guide"),
                           (dict(guided_decoding_guide_type="regex", guided_decoding_guide="a",
                                 min_tokens=np.array([[2]], dtype=np.int32)), "min_tokens cannot be combined")]:
        with pytest.raises(BadRequest, match=message):
            parse(**extra)
