"""Structured output through ``LLM`` on random-weight checkpoints of two families with real tokenizers
(Llama with byte-level BPE, Mistral with a SentencePiece-style one): unconstrained, such a model writes
garbage; constrained, every finished output must parse and validate (``jsonschema``), match its regex, be
one of its choices. Then streaming, 64 mixed concurrent requests (the unconstrained ones equal a run
without the others), prefix reuse, chunked prefill, preemption, seeds, n > 1, logprobs, stop strings,
compiling off the step loop, aborts while compiling, errors at submission, and the metrics."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from kiln.runtime import LLM, InvalidRequestError, SamplingParams
from kiln.runtime.executor import Executor

from runtime_support import assert_no_leak, get_engine, random_prompts
from structured_cases import CHOICES, GRAMMAR, GRAMMAR_RE, REGEXES, SCHEMAS, fullmatch, valid_json

pytestmark = [pytest.mark.xdist_group("structured"), pytest.mark.usefixtures("hang_watchdog")]
pytest.importorskip("xgrammar")

VOCAB = 512
MAX_TOKENS = 64   # + the longest prompt here (40 tokens) within the test engines' max_seq_len 128
FAMILIES = {"llama": {}, "mistral": {"tokenizer": "sentencepiece"}}


@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    return {fam: get_engine(checkpoint_dir(fam, **kw)) for fam, kw in FAMILIES.items()}


@pytest.fixture(scope="module", params=list(FAMILIES))
def llm(request, engines):
    with LLM(engines[request.param]) as llm:
        yield llm


def json_params(schema: dict, i: int, **kw) -> SamplingParams:
    """Greedy for even ``i``, seeded sampling for odd."""
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 == 0 else 1.0, seed=i,
                          structured_output={"json": schema, **kw})


def test_json_schemas_finish_and_validate(llm):
    params = [json_params(s, i) for i, s in enumerate(SCHEMAS * 2)]
    outs = llm.generate(["Answer in JSON:"] * len(params), params)
    finished = [(p, o) for p, o in zip(params, outs) if o.finish_reason == "stop"]
    assert len(finished) >= 0.95 * len(outs), [o.text for o in outs if o.finish_reason != "stop"]
    bad = [(p.structured_output.json, o.text) for p, o in finished if not valid_json(o.text, p.structured_output.json)]
    assert not bad, bad
    assert all(o.token_ids[-1] == 2 for _, o in finished)     # each ended on EOS, where its grammar may end
    assert_no_leak(llm)


def test_any_whitespace_json_validates(llm):
    """Whitespace anywhere JSON allows it (opt-in: a random model writes long runs of it, so fewer finish)."""
    params = [json_params(s, i, any_whitespace=True) for i, s in enumerate(SCHEMAS[:10])]
    outs = llm.generate(["Answer in JSON:"] * len(params), params)
    finished = [(p, o) for p, o in zip(params, outs) if o.finish_reason == "stop"]
    assert len(finished) >= len(outs) // 2
    assert all(valid_json(o.text, p.structured_output.json) for p, o in finished)
    assert any(re.search(r"[\n\t\r]|  ", o.text) for _, o in finished)   # more than the compact form's spaces


def test_regex_choice_grammar_and_json_object(llm):
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_output={"regex": r})
              for s in range(2) for r, _ in REGEXES]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured_output={"choice": CHOICES})
               for s in range(4)]
    params += [SamplingParams(max_tokens=40, temperature=t, seed=7, structured_output={"grammar": GRAMMAR})
               for t in (0.0, 1.0)]
    outs = llm.generate(["Fill in:"] * len(params), params)
    assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]
    n = 2 * len(REGEXES)
    for (r, py), o in zip([*REGEXES, *REGEXES], outs[:n]):
        assert fullmatch(py, o.text), (r, o.text)
    assert all(o.text in CHOICES for o in outs[n:n + 4])
    assert all(fullmatch(GRAMMAR_RE, o.text) for o in outs[n + 4:]), [o.text for o in outs[n + 4:]]
    # any JSON object: its strings have no bound, so a random model may not close them within max_tokens
    objects = llm.generate(["{"] * 8, [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s,
                                                      structured_output={"json_object": True}) for s in range(8)])
    stopped = [o for o in objects if o.finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(o.text), dict) for o in stopped)


def test_streamed_output_concatenates_to_a_valid_document(llm):
    schema = SCHEMAS[1]
    params = json_params(schema, 1)
    text, tokens, last = "", [], None
    for out in llm.stream("JSON:", params):
        text += out.delta_text
        tokens += out.delta_token_ids
        last = out
    assert last.finish_reason == "stop" and text == last.text and tokens == last.token_ids
    assert valid_json(text, schema)
    (whole,) = llm.generate(["JSON:"], params)
    assert whole.token_ids == last.token_ids   # seeded: the same as a whole answer


def test_64_mixed_requests_leave_unconstrained_ones_unchanged(llm):
    prompts = random_prompts(64, VOCAB, 3, 40, seed=11)
    plain = [SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 0.9, seed=100 + i) for i in range(32)]
    constrained = [json_params(SCHEMAS[i % len(SCHEMAS)], i) for i in range(32)]
    alone = llm.generate(prompts[:32], plain)
    mixed = llm.generate(prompts, plain + constrained)
    assert [o.token_ids for o in mixed[:32]] == [o.token_ids for o in alone]
    finished = [(p, o) for p, o in zip(constrained, mixed[32:]) if o.finish_reason == "stop"]
    assert len(finished) >= 0.95 * 32
    assert all(valid_json(o.text, p.structured_output.json) for p, o in finished)
    assert max(s.batch_size for s in llm.executor.metrics.steps) >= 16
    assert_no_leak(llm)


def test_prefix_reuse_chunked_prefill_and_preemption_keep_constrained_outputs(engines):
    """The same seeded constrained requests give the same tokens with a shared prompt prefix, with prompts
    split into chunks, and with a pool so small that requests are preempted and recomputed (their matchers
    keep their state)."""
    engine = engines["llama"]
    prefix = random_prompts(1, VOCAB, 24, 24, seed=12)[0]   # three full blocks to share
    prompts = [prefix + p for p in random_prompts(12, VOCAB, 1, 16, seed=13)]
    params = [json_params(SCHEMAS[i], i) for i in range(12)]
    with LLM(engine, enable_prefix_reuse=False) as llm:
        base = llm.generate(prompts, params)
    with LLM(engine) as llm:
        reused = llm.generate(prompts, params)
        assert llm.stats()["kv_cache"]["prefix_hits"] > 0
    with LLM(engine, max_num_tokens=16, enable_prefix_reuse=False) as llm:
        chunked = llm.generate(prompts, params)
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    with LLM(engine, capacity_policy="max_utilization", max_kv_cache_tokens=longest + 8,
             enable_prefix_reuse=False) as llm:
        # compile every grammar first: a request enters the scheduler when its grammar is ready, and on a loaded
        # machine the low-priority compiles finish one by one, so the requests would never compete for blocks
        llm.generate(prompts[:1] * len(params),
                     [SamplingParams(max_tokens=1, structured_output={"json": SCHEMAS[i]}) for i in range(12)])
        preempted = llm.generate(prompts, params)
        assert llm.stats()["counters"]["preemptions"] > 0
        assert_no_leak(llm)
    for run in (reused, chunked, preempted):
        assert [o.token_ids for o in run] == [o.token_ids for o in base]
    assert all(valid_json(o.text, p.structured_output.json) for p, o in zip(params, base) if o.finish_reason == "stop")


def test_seeds_choices_logprobs_and_stop_strings(llm):
    spec = {"json": SCHEMAS[0]}
    a, b, c = llm.generate(["x"] * 3, [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s,
                                                      structured_output=spec) for s in (5, 5, 6)])
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    hits = llm.stats()["counters"]["grammar_cache_hits"]
    n = llm.generate(["x"] * 4, [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s,
                                                structured_output=spec) for s in range(4)])
    assert llm.stats()["counters"]["grammar_cache_hits"] == hits + 4   # compiled once, for the first of all
    assert len({tuple(o.token_ids) for o in n}) > 1 and all(valid_json(o.text, SCHEMAS[0]) for o in n)

    (lp,) = llm.generate(["x"], SamplingParams(max_tokens=20, temperature=0, logprobs=5,
                                               structured_output={"choice": CHOICES}))
    assert lp.text in CHOICES and len(lp.logprobs) == len(lp.token_ids)
    for token, entry in zip(lp.token_ids, lp.logprobs):
        assert next(iter(entry)) == token and all(v <= 0 for v in entry.values())
        assert entry[token] == max(entry.values())   # greedy over the allowed tokens

    (cut,) = llm.generate(["x"], SamplingParams(max_tokens=20, temperature=0, stop=["mm"],
                                                structured_output={"choice": ["gamma delta"]}))
    assert cut.text == "ga" and cut.finish_reason == "stop" and cut.stop_reason == "mm"
    (ended,) = llm.generate(["x"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                  structured_output={"choice": ["beta"]}))
    assert ended.text == "beta" and ended.finish_reason == "stop"   # the grammar ended it despite ignore_eos
    (short,) = llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0,
                                                  structured_output={"choice": ["gamma delta"]}))
    assert short.finish_reason == "length" and "gamma delta".startswith(short.text)


def test_requests_wait_for_their_grammar_while_others_step(engines):
    engine = engines["llama"]
    with LLM(engine) as llm:
        compiler = llm.executor.grammar_compiler()
        release = threading.Event()
        real = compiler._compile
        compiler._compile = lambda grammar: (release.wait(60), real(grammar))[1]   # a compile that takes long
        other_tokens: list[int] = []
        done = threading.Event()

        def on_other(out):
            other_tokens.extend(out.delta_token_ids)
            if out.finished:
                done.set()

        llm.submit([5, 6, 7], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), callback=on_other)
        results: list = []
        rid = llm.submit("x", SamplingParams(max_tokens=MAX_TOKENS, structured_output={"json": SCHEMAS[2]}),
                         callback=lambda out: results.append(out))
        aborted: list = []
        gone = llm.submit("y", SamplingParams(structured_output={"json": SCHEMAS[3]}), callback=aborted.append)
        assert done.wait(60), "the unconstrained request did not finish while the grammars compiled"
        assert len(other_tokens) == 40 and not results
        deadline = time.monotonic() + 10   # the loop may take the two in after the other request's last step
        while llm.stats()["gauges"]["waiting"] != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.stats()["gauges"]["waiting"] == 2
        llm.abort(gone)
        deadline = time.monotonic() + 10
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert aborted and aborted[-1].finish_reason == "abort" and not aborted[-1].token_ids
        release.set()
        assert llm.executor.wait_idle(60)
        assert results[-1].finish_reason == "stop" and valid_json(results[-1].text, SCHEMAS[2]), rid
        assert_no_leak(llm)


def test_invalid_constraints_are_refused_at_submission(engines):
    engine = engines["mistral"]
    with LLM(engine) as llm:
        good = SamplingParams(max_tokens=4)
        bad = SamplingParams(structured_output={"json": {"type": "object", "properties": {"a": {"type": "strin"}}}})
        with pytest.raises(InvalidRequestError, match='invalid JSON schema in structured_output.json: .*"strin"'):
            llm.generate(["a", "b"], [good, bad])
        with pytest.raises(InvalidRequestError, match="invalid regex"):
            llm.submit("a", SamplingParams(structured_output={"regex": "[a-"}))
        stats = llm.stats()["counters"]
        assert stats["requests_rejected"] == 2 and stats["requests_submitted"] == 0   # nothing of the batch ran
        assert stats["structured_requests"] == 0
    executor = Executor(engine, tokenizer=None, start=False)
    with pytest.raises(InvalidRequestError, match="needs the tokenizer's vocabulary"):
        executor.submit([5, 6], SamplingParams(structured_output={"regex": "a"}))
    executor.close()


def test_metrics_of_structured_output(llm):
    before = llm.stats()
    out, _ = llm.generate(["x", "y"], [SamplingParams(max_tokens=30, structured_output={"regex": "[0-9]{3}"}),
                                       SamplingParams(max_tokens=5)])
    after = llm.stats()
    c0, c1 = before["counters"], after["counters"]
    assert c1["structured_requests"] - c0["structured_requests"] == 1
    assert (c1["grammar_cache_hits"] + c1["grammar_cache_misses"]) - (c0["grammar_cache_hits"]
                                                                      + c0["grammar_cache_misses"]) == 1
    h0, h1 = before["histograms"], after["histograms"]
    # one bitmask per step in which the constrained request sampled: its digits' tokens and EOS
    assert h1["grammar_mask_time"]["count"] - h0["grammar_mask_time"]["count"] == len(out.token_ids)
    assert h1["grammar_compile_time"]["count"] >= 1 and h1["grammar_mask_time"]["sum"] > 0
