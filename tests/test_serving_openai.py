"""`kiln serve` end to end: a real server subprocess on a free port, the official `openai` client (sync and
async) and httpx. Greedy outputs are checked token for token against ``LLM.generate`` on the same engine,
chat prompts against transformers' ``apply_chat_template``; then seeds, logprobs, 64 concurrent streams,
disconnects, invalid requests, backpressure, metrics, SIGTERM drain, and a step-loop failure."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.executor import MAX_STEP_FAILURES

from runtime_support import get_engine, random_prompts

pytestmark = pytest.mark.xdist_group("serving")   # one worker builds the engine and starts the servers

API_KEY = "sk-kiln-test"
MODEL = "tiny-llama"
VOCAB = 512
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name and labels, e.g. 'kiln_requests_finished_total{finish_reason="abort"}'."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out


def start_server(engine_dir: Path, log: Path, *args: str) -> Server:
    """`kiln serve` on a free port (--port 0; the port is read from the startup line)."""
    cmd = [sys.executable, "-m", "kiln.runtime.cli", "serve", str(engine_dir), "--port", "0", "--log-level", "warning",
           "--served-model-name", MODEL, "--api-key", API_KEY, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 180
    while True:
        text = log.read_text()
        if m := re.search(r"listening on (http://\S+) ", text):
            return Server(proc, m.group(1), log)
        if proc.poll() is not None:
            raise AssertionError(f"kiln serve exited with {proc.returncode}:\n{text}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"kiln serve did not start within 180 s:\n{text}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def ckpt(checkpoint_dir):
    return checkpoint_dir("llama")


@pytest.fixture(scope="module")
def engine(ckpt):
    return get_engine(ckpt)


@pytest.fixture(scope="module")
def ref(engine):
    """The in-process LLM on the same engine: the reference outputs."""
    with LLM(engine) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    s = start_server(engine.directory, tmp_path_factory.mktemp("serve") / "server.log")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.log.read_text()[-3000:]


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def greedy(llm: LLM, prompt, max_tokens: int, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, **kw))[0]


def chat_ids(hf_tokenizer, messages, template=None) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---- command line ----------------------------------------------------------------------------------------
def test_serve_flags_are_executor_config_fields(engine):
    from click.testing import CliRunner

    from kiln.runtime.cli import main
    from kiln.runtime.executor import ExecutorConfig
    from kiln.serving.cli import frontend_command

    options = {p.name: p for p in frontend_command("openai").params}
    assert {f.name for f in dataclasses.fields(ExecutorConfig)} <= set(options)
    assert "--max-kv-cache-tokens" in CliRunner().invoke(main, ["serve", "--help"]).output
    r = CliRunner().invoke(main, ["serve", str(engine.directory), "--capacity-policy", "fastest"])
    assert r.exit_code == 1 and "capacity_policy" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["serve", "--frontend", "nope", str(engine.directory)])
    assert r.exit_code == 2 and "'nope' is not" in r.output


# ---- endpoints -------------------------------------------------------------------------------------------
def test_models_health_version_and_api_key(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).max_model_len == 128
    version = httpx.get(f"{server.url}/version").json()
    assert version["version"] and version["engine"]["backend"] == "cpu"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    r = httpx.get(f"{server.url}/v1/nowhere", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_completions_equal_llm_generate(server, client, ref):
    prompts = ["The kiln fires the clay", "Tokens flow through", [5, 17, 99, 3, 250, 8], "Héllo wörld 🙂"]
    for prompt, max_tokens in zip(prompts, (12, 5, 20, 9)):
        want = greedy(ref, prompt, max_tokens)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0)
        choice = got.choices[0]
        assert choice.text == want.text and choice.finish_reason == want.finish_reason
        # token for token: one logprobs entry per generated token, with that token's text
        assert choice.logprobs.tokens == [ref.decode([t], skip_special_tokens=False) for t in want.token_ids]
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.token_ids) == got.usage.total_tokens - got.usage.prompt_tokens
        assert got.model == MODEL and got.object == "text_completion" and got.system_fingerprint.startswith("fp_kiln_")
    # logprobs=2: the legacy shape, the chosen token's logprob first among the top ones (greedy)
    want = ref.generate(["The kiln"], SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0]
    got = client.completions.create(model=MODEL, prompt="The kiln", max_tokens=6, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(want.token_ids, want.logprobs)], abs=1e-4)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(chosen, abs=1e-6)
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # several prompts in one request: one choice each, in order, usage summed
    batch = ["The kiln", "Tokens", "Memory is the wall:"]
    got = client.completions.create(model=MODEL, prompt=batch, max_tokens=6, temperature=0)
    wants = [greedy(ref, p, 6) for p in batch]
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w.text for w in wants]
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in wants)
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in wants)
    got = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=4, temperature=0)
    assert [c.text for c in got.choices] == [greedy(ref, [5, 6, 7], 4).text, greedy(ref, [8, 9], 4).text]


def test_chat_uses_the_template_like_transformers(server, client, ref, hf_tokenizer):
    messages = [{"role": "system", "content": "You fire clay."}, {"role": "user", "content": "How hot is the kiln?"}]
    ids = chat_ids(hf_tokenizer, messages)
    want = ref.generate([ids], SamplingParams(temperature=0, max_tokens=16, logprobs=3))[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0,
                                         logprobs=True, top_logprobs=3)
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want.token_ids)
    content = choice.logprobs.content
    assert [c.token for c in content] == [ref.decode([t], skip_special_tokens=False) for t in want.token_ids]
    for c, t, lp in zip(content, want.token_ids, want.logprobs):
        assert len(c.top_logprobs) == 3 and c.logprob == pytest.approx(lp[t], abs=1e-4)
        assert [x.logprob for x in c.top_logprobs] == sorted((x.logprob for x in c.top_logprobs), reverse=True)
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)   # greedy: the best token
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token
    # max_tokens (the older field) means the same; text content parts are joined
    parts = [{"role": "system", "content": [{"type": "text", "text": "You fire clay."}]}, messages[1]]
    again = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=16, temperature=0)
    assert again.choices[0].message.content == want.text


def test_streaming_sync_and_async_equal_whole_answers(server, client, ref, hf_tokenizer):
    prompt = "The potter waits by the door"
    want = greedy(ref, prompt, 20, ignore_eos=True)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert len(chunks) >= 2 and "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    messages = [{"role": "user", "content": "Tell me about memory."}]
    want_chat = ref.generate([chat_ids(hf_tokenizer, messages)], SamplingParams(temperature=0, max_tokens=24))[0]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as ac:
            stream = await ac.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                      stream=True)
            deltas = [c.choices[0].delta async for c in stream]
            whole = await ac.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
            return deltas, whole

    deltas, whole = asyncio.run(run())
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content == want_chat.text


def test_n_choices_with_a_seed_are_reproducible_and_share_the_prompt(server, client, ref):
    prompt = random_prompts(1, VOCAB, 40, 40, seed=101)[0]   # 5 full blocks of 8 tokens
    kw = dict(model=MODEL, prompt=prompt, n=3, seed=1234, temperature=1.0, max_tokens=12,
              extra_body={"ignore_eos": True})
    before = server.metrics()["kiln_prefill_tokens_computed_total"]
    first = client.completions.create(**kw)
    computed = server.metrics()["kiln_prefill_tokens_computed_total"] - before
    assert computed < 40 + 2 * 9, f"3 choices over a 40-token prompt computed {computed} prompt tokens"
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.text for c in sorted(client.completions.create(**kw).choices, key=lambda c: c.index)] == texts
    assert len(set(texts)) > 1
    for i, text in enumerate(texts):   # choice i samples with seed + i
        want = ref.generate([prompt], SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=12, ignore_eos=True))[0]
        assert text == want.text
    streamed = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts
    assert first.usage.prompt_tokens == 40 and first.usage.completion_tokens == 36


def test_stop_strings_and_echo(server, client, ref):
    checked = 0
    for p in ["The kiln fires the clay", "Memory is the wall", "Tokens flow", "A request arrives"]:
        full = greedy(ref, p, 24, ignore_eos=True)
        stop = full.text[6:9]
        if "\ufffd" in stop or full.text.index(stop) < 3:
            continue
        k = full.text.index(stop)
        got = client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0, stop=[stop, "zzzz"],
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == full.text[:k] and got.choices[0].finish_reason == "stop"
        checked += 1
    assert checked >= 2
    got = client.completions.create(model=MODEL, prompt="The kiln", max_tokens=5, temperature=0, echo=True)
    assert got.choices[0].text == "The kiln" + greedy(ref, "The kiln", 5).text


# ---- load, disconnects -----------------------------------------------------------------------------------
def test_64_concurrent_streaming_clients(server, ref):
    rng = random.Random(5)
    prompts = random_prompts(64, VOCAB, 3, 60, seed=64)
    max_tokens = [rng.randint(4, 24) for _ in prompts]
    wants = ref.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])
    before = server.metrics()

    async def one(ac, prompt, m):
        text, finish = "", None
        stream = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=m, temperature=0, stream=True)
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, finish

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, p, m) for p, m in zip(prompts, max_tokens)))

    results = asyncio.run(run())
    assert [r[0] for r in results] == [w.text for w in wants]
    assert [r[1] for r in results] == [w.finish_reason for w in wants]
    after = server.metrics()
    steps = after["kiln_batch_size_count"] - before["kiln_batch_size_count"]
    single = after['kiln_batch_size_bucket{le="1.0"}'] - before['kiln_batch_size_bucket{le="1.0"}']
    batched = steps - single
    assert batched > steps / 2, f"only {batched} of {steps} steps ran more than one sequence"
    assert (after["kiln_batch_size_sum"] - before["kiln_batch_size_sum"]) / steps > 4


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def test_client_disconnect_mid_stream_frees_blocks(server):
    """64 choices of 95 tokens (4 prompts x n=16: 4 batches' worth), left after 2 events: aborted, not finished;
    blocks freed."""
    aborted = 'kiln_requests_finished_total{finish_reason="abort"}'
    idle = server.metrics()
    assert idle["kiln_kv_cache_blocks_used"] == 0
    body = {"model": MODEL, "prompt": random_prompts(4, VOCAB, 30, 30, seed=7), "max_tokens": 95, "n": 16,
            "ignore_eos": True, "temperature": 1.0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break
    after = wait_for(lambda: (m := server.metrics())[aborted] > idle[aborted] and m, what="the choices to be aborted")
    wait_for(lambda: server.metrics()["kiln_kv_cache_blocks_used"] == 0, what="their KV blocks to be freed")
    assert after["kiln_generation_tokens_total"] - idle["kiln_generation_tokens_total"] < 64 * 95


def test_client_disconnect_before_the_answer_aborts(server):
    """A non-streaming client that gives up: its 128 choices (8 prompts x n=16: 8 batches' worth) are aborted, not
    run to the end."""
    aborted = 'kiln_requests_finished_total{finish_reason="abort"}'
    before = server.metrics()
    body = {"model": MODEL, "prompt": [[5, 6, 7, 8 + i] for i in range(8)], "n": 16, "max_tokens": 120,
            "ignore_eos": True, "temperature": 1.0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(10, read=0.3))
    after = wait_for(lambda: (m := server.metrics())[aborted] > before[aborted] and m, what="an abort")
    wait_for(lambda: server.metrics()["kiln_kv_cache_blocks_used"] == 0, what="the KV blocks to be freed")
    gen = after["kiln_generation_tokens_total"] - before["kiln_generation_tokens_total"]
    assert gen < 128 * 120, "every choice ran to the end although the client had left"


# ---- invalid requests ------------------------------------------------------------------------------------
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
INVALID = [  # (endpoint, body (dict, or raw bytes), status, param)
    (CMPL, b'{"model": "tiny-llama", "prompt": "x",', 400, None),                 # malformed JSON
    (CMPL, b"[1, 2, 3]", 400, None),                                              # not an object
    (CMPL, b"", 400, None),                                                       # empty body
    (CMPL, b'{"prompt": "\\ud800"}', 400, None),                                  # lone surrogate: not valid JSON text
    (CMPL, {}, 400, "prompt"),                                                    # missing prompt
    (CMPL, {"prompt": 5}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": ""}, 400, "prompt"),                                        # no tokens
    (CMPL, {"prompt": [1, VOCAB]}, 400, "prompt"),                                # outside the vocabulary
    (CMPL, {"prompt": [-1, 5]}, 400, "prompt"),
    (CMPL, {"prompt": [1.5, 2.0]}, 400, "prompt"),                                # ids as floats
    (CMPL, {"prompt": [True, 5]}, 400, "prompt"),                                 # ids as bools
    (CMPL, {"prompt": ["a", [1, 2]]}, 400, "prompt"),                             # mixed list
    (CMPL, {"prompt": list(range(3, 100))}, 400, "prompt"),                       # over max_input_len (96)
    (CMPL, {"prompt": [5] * 90, "max_tokens": 60}, 400, "max_tokens"),            # over max_seq_len (128)
    (CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "max_tokens": "16"}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "max_tokens": 2**40}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (CMPL, {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    (CMPL, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (CMPL, b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    (CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (CMPL, {"prompt": "x", "n": 0}, 400, "n"),
    (CMPL, {"prompt": "x", "n": 1000}, 400, "n"),
    (CMPL, {"prompt": "x", "n": 2.0}, 400, "n"),
    (CMPL, {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    (CMPL, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    (CMPL, {"prompt": "x", "seed": 1.5}, 400, "seed"),
    (CMPL, {"prompt": "x", "seed": "7"}, 400, "seed"),
    (CMPL, {"prompt": "x", "stop": [""]}, 400, "stop[0]"),
    (CMPL, {"prompt": "x", "stop": [1]}, 400, "stop[0]"),
    (CMPL, {"prompt": "x", "stop": [["ab"]]}, 400, "stop[0]"),
    (CMPL, {"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    (CMPL, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (CMPL, {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (CMPL, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    (CMPL, {"prompt": "x", "top_k": 2**40}, 400, "top_k"),
    (CMPL, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    (CMPL, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, {"prompt": "x", "max_tokens": 4, "min_tokens": 20}, 400, "min_tokens"),
    (CMPL, {"prompt": "x", "priority": "high"}, 400, "priority"),
    (CMPL, {"prompt": "x", "priority": None}, 400, "priority"),
    (CMPL, {"prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos"),
    (CMPL, {"prompt": "x", "stream": "true"}, 400, "stream"),
    (CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CMPL, {"prompt": "x", "stream": True, "stream_options": {"usage": True}}, 400, "stream_options.usage"),
    (CMPL, {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    (CMPL, {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    (CMPL, {"prompt": "x", "user": 123}, 400, "user"),
    (CMPL, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content"),
    (CHAT, {"messages": [{"role": "assistant", "content": "", "tool_calls": []}]}, 400, "messages[0].tool_calls"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "max_completion_tokens": 200}, 400, "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 200}]}, 400, "messages"),   # over max_input_len
    (CHAT, {"messages": USER, "temperature": True}, 400, "temperature"),
    (CHAT, {"messages": USER, "model": "nope"}, 404, "model"),
]


def test_invalid_requests_get_openai_errors_naming_the_field(server, client):
    before = server.metrics()
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for path, body, status, param in INVALID:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
            assert error["message"], body
    assert len(INVALID) >= 15
    after = server.metrics()
    # nothing malformed reached the runtime, every refusal is counted, and the server carries on
    assert after["kiln_requests_submitted_total"] == before["kiln_requests_submitted_total"]
    refused = sum(status in (400, 413) for _, _, status, _ in INVALID)
    assert after["kiln_requests_rejected_total"] == before["kiln_requests_rejected_total"] + refused
    assert after['kiln_http_requests_total{endpoint="/v1/completions",status="400"}'] >= 40
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)   # NaN and inf: raw-JSON cases in INVALID
    | st.text(max_size=12) | st.sampled_from([0, 1, 2, 5, 16, 0.5, 1.0, "x", [1, 2], [], {}]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "stream", "stream_options", "logprobs", "echo",
          "seed", "presence_penalty", "frequency_penalty", "user", "top_k", "min_p", "repetition_penalty",
          "min_tokens", "ignore_eos", "priority", "model", "best_of"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6),
       prompt=st.sampled_from(["The kiln", [5, 6, 7], ["a", "b"]]))
def test_arbitrary_field_values_get_a_400_or_an_answer(server, body, prompt):
    """Whatever JSON lands in whichever fields: a 400 naming one of them (404 for an unknown model), or an
    answer; never a 5xx, and the runtime keeps serving."""
    body = {"prompt": prompt, "max_tokens": 4, **body}
    r = httpx.post(f"{server.url}{CMPL}", json=body, headers=AUTH, timeout=60)
    if r.status_code == 200:
        return
    assert r.status_code in (400, 404), (body, r.text)
    param = r.json()["error"]["param"]
    assert param is None or re.split(r"[.\[]", param)[0] in body, (body, r.json())


def test_after_the_fuzzing_the_server_is_healthy_and_holds_no_blocks(server, client, ref):
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_for(lambda: server.metrics()["kiln_kv_cache_blocks_used"] == 0, what="every KV block to be free")
    metrics = server.metrics()
    assert not any(k.startswith("kiln_http_requests_total") and 'status="5' in k for k in metrics)
    assert client.completions.create(model=MODEL, prompt="The kiln", max_tokens=6, temperature=0).choices[0].text \
        == greedy(ref, "The kiln", 6).text


# ---- metrics ---------------------------------------------------------------------------------------------
def test_metrics_families(server, client):
    client.completions.create(model=MODEL, prompt="The kiln", max_tokens=4)
    r = httpx.get(f"{server.url}/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    want = {
        "histogram": ["kiln_time_to_first_token_seconds", "kiln_time_per_output_token_seconds",
                      "kiln_inter_token_latency_seconds", "kiln_e2e_request_latency_seconds",
                      "kiln_request_queue_time_seconds", "kiln_batch_size", "kiln_step_time_seconds"],
        "counter": ["kiln_prompt_tokens", "kiln_generation_tokens", "kiln_preemptions", "kiln_requests_finished",
                    "kiln_prefix_cache_queries", "kiln_prefix_cache_hits", "kiln_http_requests"],
        "gauge": ["kiln_num_requests_running", "kiln_num_requests_waiting", "kiln_kv_cache_blocks_used",
                  "kiln_kv_cache_blocks_total", "kiln_kv_cache_usage_ratio", "kiln_prefix_cache_hit_rate",
                  "kiln_healthy"],
    }
    for kind, names in want.items():
        for name in names:
            assert name in families and families[name].type == kind, name
    reasons = {s.labels["finish_reason"] for s in families["kiln_requests_finished"].samples if s.labels}
    assert reasons == {"stop", "length", "abort", "error"}
    statuses = {s.labels["status"] for s in families["kiln_http_requests"].samples if s.name.endswith("_total")}
    assert "200" in statuses
    ttft = {s.name: s.value for s in families["kiln_time_to_first_token_seconds"].samples
            if s.labels.get("le") in (None, "+Inf")}
    assert ttft["kiln_time_to_first_token_seconds_count"] >= 1
    assert ttft["kiln_time_to_first_token_seconds_bucket"] == ttft["kiln_time_to_first_token_seconds_count"]


# ---- backpressure ----------------------------------------------------------------------------------------
def test_max_waiting_answers_429_and_keeps_every_accepted_request(engine, ref, hf_tokenizer, tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    srv = start_server(engine.directory, tmp_path / "server.log", "--max-waiting", "2",
                       "--chat-template", str(template))
    try:
        prompts = random_prompts(20, VOCAB, 5, 30, seed=20)
        wants = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=60) as http:
                return await asyncio.gather(*(http.post(CMPL, json={
                    "model": MODEL, "prompt": p, "max_tokens": 30, "temperature": 0, "ignore_eos": True})
                    for p in prompts))

        responses = asyncio.run(run())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 2, codes
        for r, want in zip(responses, wants):
            if r.status_code == 429:
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
            else:
                assert r.json()["choices"][0]["text"] == want.text
                assert r.json()["usage"]["completion_tokens"] == 30
        assert httpx.get(f"{srv.url}/health").status_code == 200
        # --chat-template replaces the engine's template
        messages = [{"role": "user", "content": "Hello"}]
        r = httpx.post(f"{srv.url}{CHAT}", headers=AUTH, timeout=30,
                       json={"messages": messages, "max_tokens": 3, "temperature": 0})
        assert r.json()["usage"]["prompt_tokens"] == len(chat_ids(hf_tokenizer, messages, CHATML))
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


# ---- shutdown --------------------------------------------------------------------------------------------
def stream_in_thread(url: str, body: dict, results: list, started: threading.Event | None = None) -> threading.Thread:
    """A streaming completion read to its end on a thread; appends (status, text, finish, error events)."""
    def run():
        text, finish, errors, status = "", None, [], None
        try:
            with httpx.stream("POST", f"{url}{CMPL}", json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
                status = r.status_code
                for line in r.iter_lines():
                    if started is not None:
                        started.set()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        errors.append(event["error"])
                    for c in event.get("choices", []):
                        text += c["text"]
                        finish = c["finish_reason"] or finish
        finally:
            results.append((status, text, finish, errors))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_sigterm_drains_in_flight_requests_then_exits_0(engine, ref, tmp_path):
    # one sequence a step, so that the drain (the 32 requests of 100 tokens one after another, thousands of steps)
    # outlasts the checks below by far: with a full batch a faster decode finished every request, and the server
    # exited, between /health's 503 and the refused request (connection refused)
    srv = start_server(engine.directory, tmp_path / "server.log", "--max-batch-size", "1")
    try:
        prompts = random_prompts(32, VOCAB, 8, 20, seed=30)
        wants = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        results, threads = [], []
        for p in prompts:
            threads.append(stream_in_thread(srv.url, {"model": MODEL, "prompt": p, "max_tokens": 100,
                                                      "temperature": 0, "ignore_eos": True}, results))

        def received() -> float:   # every request the server has taken: finished, running or queued
            m = srv.metrics()
            done = sum(v for k, v in m.items() if k.startswith("kiln_requests_finished_total{"))
            return done + m["kiln_num_requests_running"] + m["kiln_num_requests_waiting"]
        wait_for(lambda: received() >= len(prompts), timeout=60, what="the server to take every request")
        srv.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 503, what="/health to report the drain")
        r = httpx.post(f"{srv.url}{CMPL}", headers=AUTH, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        for t in threads:
            t.join(60)
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    assert sorted(r[1] for r in results) == sorted(w.text for w in wants)
    assert all(r[0] == 200 and r[2] == "length" and not r[3] for r in results)
    log = srv.log.read_text()
    assert (m := re.search(r"waiting up to 30 s for (\d+) in flight", log)) and int(m.group(1)) >= 1, log[-2000:]


def test_sigterm_past_the_shutdown_timeout_aborts_the_rest(engine, tmp_path):
    srv = start_server(engine.directory, tmp_path / "server.log", "--shutdown-timeout", "0")
    try:
        results, started = [], threading.Event()
        t = stream_in_thread(srv.url, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 120, "temperature": 0,
                                       "ignore_eos": True, "n": 8}, results, started)
        assert started.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    (status, text, finish, errors), = results
    # the error event carries the body a 503 before the headers would: code null, type server_error
    assert status == 200 and errors and "shutting down" in errors[0]["message"]
    assert errors[0]["code"] is None and errors[0]["type"] == "server_error" and errors[0]["param"] is None


# ---- step-loop failure (in-process server: the fault is injected into the real engine) --------------------
class FailingEngine:
    """The real engine, whose ``run`` raises once ``armed`` (a fault in the step loop: each failed step fails
    its requests; MAX_STEP_FAILURES in a row stop the executor)."""

    def __init__(self, engine):
        self._engine = engine
        self.armed = False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run(self, inputs):
        if self.armed:
            raise RuntimeError("injected engine fault")
        return self._engine.run(inputs)


def test_step_loop_failure_gives_500_and_unhealthy(engine):
    import uvicorn

    from kiln.serving.openai.app import create_app

    faulty = FailingEngine(engine)
    llm = LLM(faulty)
    app = create_app(llm, model_name=MODEL, chat_template=None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        wait_for(lambda: server.started, what="uvicorn to start")
        with httpx.Client(base_url=url, timeout=30) as http:
            ok = http.post(CMPL, json={"prompt": [5, 6], "max_tokens": 3, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == greedy(llm, [5, 6], 3).text
            r = http.post(CHAT, json={"messages": USER})   # no chat template: a 400 that says how to add one
            assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
            faulty.armed = True   # one failed step fails its request; the third in a row stops the executor
            for attempt in range(1, MAX_STEP_FAILURES + 1):
                r = http.post(CMPL, json={"prompt": [5, 6], "max_tokens": 3})
                assert r.status_code == 500 and "injected engine fault" in r.json()["error"]["message"]
                health = http.get("/health")
                assert health.status_code == (200 if attempt < MAX_STEP_FAILURES else 503), health.text
            assert "failed 3 steps in a row" in health.json()["detail"]
            r = http.post(CMPL, json={"prompt": [5, 6], "max_tokens": 3})
            assert r.status_code == 503 and "not serving" in r.json()["error"]["message"]
            metrics = http.get("/metrics").text
            assert "kiln_healthy 0.0" in metrics
            assert f'kiln_requests_finished_total{{finish_reason="error"}} {float(MAX_STEP_FAILURES)}' in metrics
    finally:
        server.should_exit = True
        thread.join(30)
        llm.shutdown()
        sock.close()
