"""Serving through NVIDIA Triton Inference Server: a real tritonserver (the one bundled in the nvidia-pytriton
wheel, started by `kiln serve --frontend triton` on free ports) and real clients (tritonclient HTTP/gRPC, plain
HTTP for /generate). Outputs are checked token for token against kiln's LLM on the same engine in this process.

Two servers: the session's (decoupled, model "kiln") and, for the tests that need another repository, a
non-decoupled one named "ensemble" with a small admission queue.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kiln.runtime import LLM, ConfigError, ExecutorConfig, SamplingParams
from kiln.runtime.cli import main
from kiln.serving.triton.launcher import Ports, TritonServer
from kiln.serving.triton.repository import RepoOptions, check_runtime, parameters, read_parameters

from runtime_support import get_engine

if find_spec("pytriton") is None or find_spec("tritonclient") is None:
    pytest.skip("the triton extra is not installed (pip install 'kiln-llm[triton]')", allow_module_level=True)

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402

pytestmark = pytest.mark.xdist_group("triton")

SHM = Path("/dev/shm")
WIRE = {np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64", np.dtype(np.uint64): "UINT64",
        np.dtype(np.float32): "FP32", np.dtype(np.bool_): "BOOL", np.dtype(np.object_): "BYTES"}
PROMPTS = ["The kiln fires the clay", "Tokens flow through the engine", "Héllo wörld 🙂", "def add(a, b):"]
# Long generations, so a stream is surely still generating when it is cancelled: 4000 tokens take the tiny model
# several seconds, far longer than a loaded test process takes to react to a response (it has taken ~1 s).
CHECKPOINT = dict(max_position_embeddings=4096)
BUILD = dict(max_seq_len=4096)
LONG = 4000


# ---- helpers ------------------------------------------------------------------------------------------
def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: every socket stays bound until all are picked (picked one at a time, the OS may
    hand the same port out twice: a CI run's tritonserver got gRPC and metrics on one port and refused to start)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tensor(value, dtype) -> np.ndarray:
    """A request tensor with the batch dimension: scalars -> [1, 1], lists -> [1, N]."""
    if dtype is np.object_:
        value = [v.encode() if isinstance(v, str) else v for v in (value if isinstance(value, list) else [value])]
        return np.array([value], dtype=np.object_)
    return np.array([value if isinstance(value, list) else [value]], dtype=dtype)


def grpc_inputs(**arrays: np.ndarray) -> list:
    out = []
    for name, arr in arrays.items():
        x = grpcclient.InferInput(name, list(arr.shape), WIRE[arr.dtype])
        x.set_data_from_numpy(arr)
        out.append(x)
    return out


def request(text: str | None = None, max_tokens: int | None = 16, **extra) -> dict[str, np.ndarray]:
    arrays = {}
    if text is not None:
        arrays["text_input"] = tensor(text, np.object_)
    if max_tokens is not None:
        arrays["max_tokens"] = tensor(max_tokens, np.int32)
    arrays.update(extra)
    return arrays


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def metrics(server) -> dict[str, float]:
    """Triton's metrics, keyed by the sample line without its value (e.g. 'kiln_healthy{...}')."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric(values: dict[str, float], name: str, **labels) -> float:
    hits = [v for k, v in values.items()
            if k.split("{")[0] == name and all(f'{lk}="{lv}"' in k for lk, lv in labels.items())]
    assert hits, f"metric {name}{labels} not found"
    return sum(hits)


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class StreamClient:
    """One gRPC stream; collects each request's responses until its last one (or an error)."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.results: dict[str, list] = {}
        self.done: dict[str, threading.Event] = {}
        self.first: dict[str, threading.Event] = {}   # set by a request's first response
        self.errors: dict[str, str] = {}
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error) -> None:
        if error is not None:
            rid = error.request_id() if hasattr(error, "request_id") else None
            if rid not in self.done:
                pending = [r for r, e in self.done.items() if not e.is_set()]
                if not pending:   # the client's own CANCELLED after close(cancel=True): nothing waits for it
                    return
                rid = pending[0]
            self.errors[rid] = error.message()
            self.done[rid].set()
            return
        rid = result.get_response().id
        self.results[rid].append(result)
        self.first[rid].set()
        if result.as_numpy("finish_reason") is not None:
            self.done[rid].set()

    def send(self, rid: str, arrays: dict[str, np.ndarray], model: str = "kiln") -> None:
        self.results[rid], self.done[rid], self.first[rid] = [], threading.Event(), threading.Event()
        self.client.async_stream_infer(model, grpc_inputs(**arrays), request_id=rid)

    def wait(self, rid: str, timeout: float = 60) -> list:
        assert self.done[rid].wait(timeout), f"request {rid} did not finish"
        return self.results[rid]

    def tokens(self, rid: str) -> list[int]:
        return [int(t) for r in self.results[rid] for t in r.as_numpy("output_ids").reshape(-1)]

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


class Served:
    """`kiln serve --frontend triton` as a subprocess on free ports; its tritonserver lives in its own session."""

    def __init__(self, engine_dir: Path, workdir: Path, *args: str):
        self.workdir = workdir
        self.ports = dict(zip(("http", "grpc", "metrics"), free_ports(3)))
        self.log_path = workdir / "serve.log"
        workdir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "kiln.runtime.cli", "serve", "--frontend", "triton", str(engine_dir),
               "--http-port", str(self.ports["http"]), "--grpc-port", str(self.ports["grpc"]),
               "--metrics-port", str(self.ports["metrics"]), "--work-dir", str(workdir / "work"), *args]
        self.log = open(self.log_path, "w")
        self.stopped: tuple[int | None, float] | None = None
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.http = f"http://127.0.0.1:{self.ports['http']}"
        self.grpc = f"127.0.0.1:{self.ports['grpc']}"
        self.metrics_url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"kiln serve did not become ready:\n{self.output()[-6000:]}")
            time.sleep(0.25)

    def processes(self) -> list[int]:
        """Live processes started for this server (tritonserver and its stubs name the work folder)."""
        mine = []
        needle = str(self.workdir / "work").encode()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if needle in (entry / "cmdline").read_bytes() and (entry / "stat").read_text().split()[2] != "Z":
                        mine.append(int(entry.name))
                except OSError:
                    pass
        return mine

    def shm_files(self) -> list[Path]:
        return sorted(SHM.glob(f"triton_python_backend_shm_region_kiln{self.proc.pid}_*"))

    def stop(self, timeout: float = 30) -> tuple[int | None, float]:
        """SIGTERM to `kiln serve`; returns its exit code and the seconds it took (those of the first call when
        called again). Kills anything left."""
        if self.stopped is not None:
            return self.stopped
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
            self.proc.kill()
            self.proc.wait()
        elapsed = time.monotonic() - t0
        for pid in self.processes():      # only if the launcher failed to clean up: never leave them running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
        self.stopped = (code, elapsed)
        return self.stopped


def start_server(engine_dir: Path, workdir: Path, *args: str) -> Served:
    server = Served(engine_dir, workdir, *args)
    server.wait_ready()
    return server


# ---- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return get_engine(checkpoint_dir("llama", **CHECKPOINT), **BUILD)


@pytest.fixture(scope="module")
def llm(engine):
    """The in-process reference: kiln's LLM on the same engine."""
    llm = LLM(engine, max_kv_cache_tokens=8192)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    """The main server: decoupled (streaming), model "kiln"."""
    served = start_server(engine.directory, tmp_path_factory.mktemp("triton-main"), "--max-kv-cache-tokens", "8192")
    yield served
    code, _ = served.stop()
    assert code == 0, served.output()[-3000:]
    assert not served.processes() and not served.shm_files()


def greedy(llm: LLM, prompt, max_tokens: int, **kw):
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, **kw))[0]


# ---- repository rendering -----------------------------------------------------------------------------
def test_triton_repo_refuses_bad_options_before_writing(engine, tmp_path):
    runner = CliRunner()
    out = tmp_path / "repo"
    cases = {
        ("--instances", "0"): "--instances",
        ("--max-batch-size", "99"): "1..16",
        ("--max-num-tokens", "0"): "max_num_tokens must be an integer >= 1",
        ("--kv-cache-memory-fraction", "1.5"): "(0, 1]",
        ("--max-kv-cache-tokens", "3"): "one KV block",
        ("--max-queue-size", "-1"): "--max-queue-size",
        ("--capacity-policy", "fifo"): "guaranteed_no_evict",
        ("--model-name", "my model"): "--model-name",
        ("--instances", "two"): "not a valid integer",
    }
    for args, expected in cases.items():
        res = runner.invoke(main, ["triton-repo", str(engine.directory), "-o", str(out), *args])
        assert res.exit_code != 0 and expected in res.output, (args, res.output)
        assert not out.exists(), f"{args}: something was written"
    res = runner.invoke(main, ["triton-repo", str(tmp_path / "missing"), "-o", str(out)])
    assert res.exit_code != 0 and "not an engine directory" in res.output

    res = runner.invoke(main, ["triton-repo", str(engine.directory), "-o", str(out), "--model-name", "ensemble",
                               "--instances", "2", "--no-decoupled", "--max-batch-size", "4", "--copy-engine"])
    assert res.exit_code == 0, res.output
    config = (out / "ensemble" / "config.pbtxt").read_text()
    assert 'name: "ensemble"' in config and "decoupled: false" in config and "count: 2" in config
    assert 'key: "max_batch_size"\n  value: { string_value: "4" }' in config
    assert 'key: "engine_dir"\n  value: { string_value: "engine" }' in config
    assert (out / "ensemble" / "1" / "engine" / "rank0.engine").is_file()
    model_py = (out / "ensemble" / "1" / "model.py").read_text()
    assert "from kiln.serving.triton.model import TritonPythonModel" in model_py
    # TensorRT-LLM's names and types for the tensors its clients send and read
    for name, dtype, dims in [("text_input", "TYPE_STRING", "[ 1 ]"), ("input_ids", "TYPE_INT32", "[ -1 ]"),
                              ("max_tokens", "TYPE_INT32", "[ 1 ]"), ("stream", "TYPE_BOOL", "[ 1 ]"),
                              ("seed", "TYPE_UINT64", "[ 1 ]"), ("stop_words", "TYPE_STRING", "[ -1 ]"),
                              ("output_ids", "TYPE_INT32", "[ -1, -1 ]"), ("text_output", "TYPE_STRING", "[ -1 ]"),
                              ("arrival_time_ns", "TYPE_INT64", "[ 1 ]")]:
        assert f'name: "{name}"\n    data_type: {dtype}\n    dims: {dims}' in config, name
    res = runner.invoke(main, ["triton-repo", str(engine.directory), "-o", str(out), "--model-name", "ensemble"])
    assert res.exit_code != 0 and "exists" in res.output
    # --int64-inputs: every INT32 input INT64 (JSON integers then arrive unwrapped); UINT64 inputs and outputs as before
    res = runner.invoke(main, ["triton-repo", str(engine.directory), "-o", str(tmp_path / "wide"), "--int64-inputs"])
    assert res.exit_code == 0, res.output
    config = (tmp_path / "wide" / "kiln" / "config.pbtxt").read_text()
    assert "TYPE_INT32" not in config.split("output [")[0]
    for name, dtype in [("input_ids", "TYPE_INT64"), ("max_tokens", "TYPE_INT64"), ("end_id", "TYPE_INT64"),
                        ("seed", "TYPE_UINT64"), ("lora_task_id", "TYPE_UINT64"), ("output_ids", "TYPE_INT32")]:
        assert f'name: "{name}"\n    data_type: {dtype}' in config, name


def test_runtime_options_from_config_parameters(engine):
    """The model reads its options back from config.pbtxt parameters: a hand-edited value is checked too."""
    bounds = engine.config.bounds
    written = parameters(RepoOptions(max_queue_size=3, runtime=ExecutorConfig(
        max_batch_size=4, kv_cache_memory_fraction=None, max_kv_cache_tokens=512, capacity_policy="max_utilization",
        enable_prefix_reuse=False)), "/x")
    assert written["kv_cache_memory_fraction"] == "" and written["enable_prefix_reuse"] == "false"
    config, max_queue_size = read_parameters(written)
    assert (config.max_batch_size, config.kv_cache_memory_fraction, config.max_kv_cache_tokens, config.capacity_policy,
            config.enable_prefix_reuse, max_queue_size) == (4, None, 512, "max_utilization", False, 3)
    assert read_parameters({})[0] == ExecutorConfig()
    for params, expected in [
        ({"max_batch_size": "four"}, "max_batch_size='four': allowed values are an integer"),
        ({"enable_prefix_reuse": "maybe"}, "enable_prefix_reuse='maybe': allowed values are true or false"),
        ({"max_queue_size": "-1"}, "max_queue_size=-1: allowed values are >= 0"),
        ({"kv_cache_memory_fraction": "0"}, "kv_cache_memory_fraction must be a finite number in (0, 1]"),
        ({"max_num_tokens": "100000"}, "max_num_tokens=100000: allowed values are 1.."),
        ({"capacity_policy": "fifo"}, "capacity_policy must be one of"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            check_runtime(*read_parameters(params), bounds)


# ---- the decoupled server -----------------------------------------------------------------------------
def test_http_generate_matches_llm(server, llm):
    for prompt in PROMPTS:
        ref = greedy(llm, prompt, 12)
        status, body = post(f"{server.http}/v2/models/kiln/generate",
                            {"text_input": prompt, "max_tokens": 12, "exclude_input_in_output": True})
        assert status == 200, body
        assert body["output_ids"] == ref.token_ids and body["text_output"] == ref.text
        assert body["sequence_length"] == len(ref.token_ids) and body["finish_reason"] == ref.finish_reason
        assert body["num_input_tokens"] == len(ref.prompt_token_ids)
        assert body["arrival_time_ns"] <= body["first_token_time_ns"] <= body["last_token_time_ns"]
        # TensorRT-LLM's default: the prompt in front of the output
        status, body = post(f"{server.http}/v2/models/kiln/generate", {"text_input": prompt, "max_tokens": 12})
        assert body["output_ids"] == ref.prompt_token_ids + ref.token_ids and body["text_output"] == prompt + ref.text
    # token ids in, no sampling inputs: greedy, as TensorRT-LLM
    ids = llm.encode(PROMPTS[0])[0]
    status, body = post(f"{server.http}/v2/models/kiln/generate",
                        {"input_ids": ids + [7, 8, 9], "input_lengths": len(ids), "max_tokens": 12,
                         "exclude_input_in_output": True})
    ref = greedy(llm, ids, 12)
    assert body["output_ids"] == ref.token_ids
    status, body = post(f"{server.http}/v2/models/kiln/generate", {"input_ids": ids, "max_tokens": 12})
    assert body["output_ids"] == ids + ref.token_ids and body["text_output"] == llm.decode(ids) + ref.text
    # seeded sampling is reproducible and equals the in-process result; log-probs come along
    sampled = dict(temperature=0.75, top_k=40, top_p=0.875, seed=1234)   # exact in float32
    ref = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=16, logprobs=0, **sampled))[0]
    status, body = post(f"{server.http}/v2/models/kiln/generate",
                        {"text_input": PROMPTS[1], "max_tokens": 16, "exclude_input_in_output": True,
                         "return_log_probs": True, **sampled})
    assert body["output_ids"] == ref.token_ids
    ref_lps = [next(iter(d.values())) for d in ref.logprobs]
    assert np.allclose(body["output_log_probs"], ref_lps, atol=1e-4)
    assert math.isclose(body["cum_log_probs"], sum(ref_lps), abs_tol=1e-3)
    # the largest UINT64 seed is a valid seed, not a crash of the step loop
    status, body = post(f"{server.http}/v2/models/kiln/generate", {"text_input": PROMPTS[1], "max_tokens": 4,
                                                                    "top_k": 5, "seed": 2**64 - 1, "priority": 3})
    assert status == 200 and (body["num_output_tokens"] == 4 or body["finish_reason"] == "stop"), body
    # stop_words end the text before them; end_id replaces EOS
    text = greedy(llm, PROMPTS[2], 30, ignore_eos=True).text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    status, body = post(f"{server.http}/v2/models/kiln/generate",
                        {"text_input": PROMPTS[2], "max_tokens": 30, "exclude_input_in_output": True,
                         "stop_words": [stop, ""], "end_id": -1})
    assert body["finish_reason"] == "stop" and body["text_output"] == text[:text.index(stop)]


def test_guided_decoding_inputs_constrain_the_output(server, llm):
    """TensorRT-LLM's guided decoding inputs: outputs equal kiln's LLM with the same structured_output and
    validate; a bad guide is refused naming the input."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    guides = [("json_schema", json.dumps(schema), {"json": schema}), ("regex", "[a-z]{2,5}-[0-9]{2}", None),
              ("ebnf_grammar", 'root ::= "x=" [0-9] [0-9]?', None), ("json", None, {"json_object": True})]
    for kind, guide, spec in guides:
        spec = spec or {"regex" if kind == "regex" else "grammar": guide}
        ref = greedy(llm, PROMPTS[0], 40, structured_output=spec)
        body = {"text_input": PROMPTS[0], "max_tokens": 40, "exclude_input_in_output": True,
                "guided_decoding_guide_type": kind, **({"guided_decoding_guide": guide} if guide else {})}
        status, out = post(f"{server.http}/v2/models/kiln/generate", body)
        assert status == 200 and out["output_ids"] == ref.token_ids and out["text_output"] == ref.text, (kind, out)
        if kind == "json_schema":
            jsonschema.validate(json.loads(out["text_output"]), schema)
        elif kind == "regex":
            assert re.fullmatch("[a-z]{2,5}-[0-9]{2}", out["text_output"]), out
    for fields, message in [({"guided_decoding_guide_type": "xml"}, "guided_decoding_guide_type must be one of"),
                            ({"guided_decoding_guide_type": "regex"}, "needs guided_decoding_guide"),
                            ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": '{"type": "x"}'},
                             "invalid JSON schema")]:
        status, out = post(f"{server.http}/v2/models/kiln/generate", {"text_input": "hi", "max_tokens": 4, **fields})
        assert status == 400 and message in out["error"], out


def test_http_generate_stream_sse(server, llm):
    ref = greedy(llm, PROMPTS[3], 20)
    req = urllib.request.Request(f"{server.http}/v2/models/kiln/generate_stream",
                                 data=json.dumps({"text_input": PROMPTS[3], "max_tokens": 20, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.read().decode().splitlines() if line.startswith("data:")]
    # one event per step (tokens that queue up behind a slow client path go out together)
    ids = [e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]] for e in events]
    assert all(e["sequence_length"] == len(i) for e, i in zip(events, ids))
    assert [t for i in ids for t in i] == ref.token_ids
    assert "".join(e["text_output"] for e in events) == ref.text
    assert events[-1]["finish_reason"] == ref.finish_reason and "finish_reason" not in events[0]


def test_grpc_16_concurrent_streams_batch_in_flight(server, llm):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(16)]
    # long enough that the streams overlap however slowly 16 gRPC clients connect (at 24-69 tokens, steps of a
    # few ms could finish early streams before the last ones arrived: 1.9 tokens a step in one CI run)
    lengths = [64 + 8 * i for i in range(16)]
    refs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    before = metrics(server)
    clients = [StreamClient(server.grpc) for _ in range(16)]
    try:
        start = threading.Barrier(16)

        def run(i):
            start.wait()
            clients[i].send(f"r{i}", request(prompts[i], lengths[i], stream=tensor(True, np.bool_),
                                             end_id=tensor(-1, np.int32)))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, c in enumerate(clients):
            c.wait(f"r{i}")
            assert not c.errors, c.errors
            assert c.tokens(f"r{i}") == refs[i].token_ids, i
            text = "".join(r.as_numpy("text_output")[0, 0].decode() for r in c.results[f"r{i}"])
            assert text == refs[i].text
    finally:
        for c in clients:
            c.close()
    generated = sum(lengths)
    # kiln generated every token in fewer steps than tokens: steps carried several Triton requests at once
    after = wait_for(lambda: (m := metrics(server)) and metric(m, "kiln_generation_tokens_total")
                     - metric(before, "kiln_generation_tokens_total") >= generated and m, what="token counters")
    steps = (metric(after, "nv_trt_llm_general_metrics", general_type="iteration_counter")
             - metric(before, "nv_trt_llm_general_metrics", general_type="iteration_counter"))
    assert generated / steps > 2, f"{generated} tokens in {steps} steps: requests did not batch"
    assert metric(after, "kiln_step_batch_size", quantile="0.99") > 1
    assert metric(after, "kiln_time_to_first_token_seconds_count") >= 16
    assert metric(after, "nv_llm_output_token_len_count") >= 16


def test_cancelled_stream_frees_its_kv_blocks(server, llm):
    def aborted(m=None):
        return metric(m or metrics(server), "kiln_requests_finished_total", finish_reason="abort")

    def used(m):
        return metric(m, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used")

    def ended(reason):
        return metric(metrics(server), "kiln_requests_finished_total", finish_reason=reason)

    idle = wait_for(lambda: (m := metrics(server))
                    and metric(m, "nv_trt_llm_request_metrics", request_type="active") == 0 and m,
                    what="an idle server")
    assert used(idle) == 0
    aborted_before = aborted(idle)
    # The server sees a cancellation within ~0.1 s, but on a loaded machine the tiny model can finish its 4000
    # tokens (~2.6 s idle) before the client's cancel gets there: that attempt ends by length and shows nothing
    # about cancelling, so it is tried again (a cancel that never aborts fails every attempt).
    for attempt in range(4):
        rid, length_before = f"long{attempt}", ended("length")
        client = StreamClient(server.grpc)
        client.send(rid, request(PROMPTS[0], LONG, stream=tensor(True, np.bool_), end_id=tensor(-1, np.int32)))
        # cancel on the first response (polling the token count instead once saw all tokens the server had sent)
        assert client.first[rid].wait(60), "no first response"
        finished_first = client.done[rid].is_set()
        client.close(cancel=True)
        assert not finished_first and len(client.tokens(rid)) < LONG, "the request ended before it was cancelled"
        wait_for(lambda: aborted() == aborted_before + 1 or ended("length") == length_before + 1,
                 what="kiln to end the cancelled request")
        if aborted() == aborted_before + 1:
            break
    else:
        raise AssertionError("the cancelled request ran to its length in every attempt: kiln never aborted it")
    # the same over HTTP: a client that disconnects from /generate_stream
    req = urllib.request.Request(f"{server.http}/v2/models/kiln/generate_stream", data=json.dumps(
        {"text_input": PROMPTS[1], "max_tokens": LONG, "stream": True, "end_id": -1}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        for _ in range(10):
            r.readline()
    # a snapshot that counts both aborts shows the blocks in use either from before them (> 0) or back at idle
    seen = []
    try:
        wait_for(lambda: (m := metrics(server)) and seen.append((aborted(m), used(m))) is None
                 and aborted(m) == aborted_before + 2 and used(m) == 0, timeout=30,
                 what="both aborts and the KV blocks in use back at 0")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; (aborted, used blocks) seen last: {seen[-3:]}") from None


def test_bad_requests_get_named_errors_while_good_streams_run(server, llm, engine):
    vocab = engine.config.model.vocab_size
    good = {f"g{i}": (PROMPTS[i], 150 + 10 * i) for i in range(4)}
    refs = {rid: greedy(llm, p, n, ignore_eos=True) for rid, (p, n) in good.items()}
    bad = {   # request -> what the error must say
        "no-prompt": ({"max_tokens": tensor(4, np.int32)}, "text_input"),
        "two-prompts": (request("hi", 4, input_ids=tensor([5, 6], np.int32)), "exactly one prompt"),
        "no-max-tokens": (request("hi", None), "max_tokens is required"),
        "max-tokens-0": (request("hi", 0), "max_tokens must be >= 1"),
        "max-tokens-negative": (request("hi", -3), "max_tokens must be >= 1"),
        "prompt-too-long": (request(None, 4, input_ids=tensor([5] * 200, np.int32)), "max_input_len"),
        "over-max-seq-len": (request("hi", BUILD["max_seq_len"]), "max_seq_len"),
        "ids-outside-vocab": (request(None, 4, input_ids=tensor([5, vocab + 3], np.int32)), "outside the vocabulary"),
        "input-lengths-0": (request(None, 4, input_ids=tensor([5, 6], np.int32), input_lengths=tensor(0, np.int32)),
                            "input_lengths"),
        "wrong-dtype": ({"text_input": tensor("hi", np.object_), "max_tokens": tensor(4.0, np.float32)},
                        "'max_tokens' data-type is 'FP32'"),
        "unknown-input": (request("hi", 4, foo=tensor(1, np.int32)), "foo"),
        "empty-text": (request("", 4), "text_input is empty"),
        "not-utf8": ({"text_input": np.array([[b"\xff\xfe"]], dtype=np.object_), "max_tokens": tensor(4, np.int32)},
                     "UTF-8"),
        "negative-temperature": (request("hi", 4, temperature=tensor(-1.0, np.float32)), "temperature"),
        "nan-temperature": (request("hi", 4, temperature=tensor(float("nan"), np.float32)), "finite"),
        "top-p-above-1": (request("hi", 4, top_p=tensor(1.5, np.float32)), "top_p"),
        "zero-repetition-penalty": (request("hi", 4, repetition_penalty=tensor(0.0, np.float32)), "repetition_penalty"),
        "min-over-max": (request("hi", 4, min_tokens=tensor(9, np.int32)), "min_tokens"),
        "end-id-outside-vocab": (request("hi", 4, end_id=tensor(vocab, np.int32)), "end_id"),
        "beam-search": (request("hi", 4, beam_width=tensor(2, np.int32)), "beam_width"),
        "bad-words": (request("hi", 4, bad_words=tensor(["foo"], np.object_)), "bad_words"),
        "generation-logits": (request("hi", 4, return_generation_logits=tensor(True, np.bool_)),
                              "return_generation_logits"),
    }
    refused_before = metric(metrics(server), "kiln_requests_refused_total", reason="invalid")
    streams, probe = StreamClient(server.grpc), StreamClient(server.grpc)
    try:
        for rid, (prompt, n) in good.items():
            streams.send(rid, request(prompt, n, stream=tensor(True, np.bool_), end_id=tensor(-1, np.int32)))
        wait_for(lambda: all(streams.results[r] for r in good), what="the good streams to start")
        for rid, (arrays, expected) in bad.items():
            probe.send(rid, arrays)
            assert probe.done[rid].wait(30), rid
            assert rid in probe.errors and expected in probe.errors[rid], (rid, probe.errors.get(rid))
        for rid in good:
            streams.wait(rid)
            assert not streams.errors and streams.tokens(rid) == refs[rid].token_ids, rid
    finally:
        streams.close()
        probe.close()
    status, body = post(f"{server.http}/v2/models/kiln/generate", {"text_input": "hi", "max_tokens": "eight"})
    assert status >= 400 and "error" in body
    status, body = post(f"{server.http}/v2/models/kiln/generate", {"text_input": "hi", "max_tokens": 0})
    assert status == 400 and "max_tokens must be >= 1" in body["error"]
    assert server.ready()
    model_level = len(bad) - 2   # a wrong dtype or an unknown input is refused by Triton itself
    wait_for(lambda: metric(metrics(server), "kiln_requests_refused_total", reason="invalid") - refused_before
             == model_level + 1, what="the refusals to be counted")


# ---- an engine taking LoRA adapters: lora_name and lora_task_id select them ---------------------------
def test_lora_name_and_task_id_select_adapters(checkpoint_dir, tmp_path):
    """Adapters given by --lora-modules (one named "7": TensorRT-LLM's lora_task_id 7) generate the tokens of the
    in-process LLM with the same adapters (which tests/test_lora.py checks against PeftModel)."""
    from test_lora import ADAPTERS, MAX_RANK, TARGETS, make_adapter

    ckpt = checkpoint_dir("llama", **CHECKPOINT)
    engine = get_engine(ckpt, lora_target_modules=TARGETS["llama"], max_lora_rank=MAX_RANK, **BUILD)
    adapters = {name: make_adapter(ckpt, tmp_path / f"adapter-{name}", seed, **ADAPTERS["llama"][kind])
                for seed, (name, kind) in enumerate([("sql", "a8"), ("7", "a16")])}
    with LLM(engine, lora_modules=adapters) as ref:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        want = {name: ref.generate([PROMPTS[0]], params, lora=name)[0].token_ids for name in (None, "sql", "7")}
    assert len({tuple(v) for v in want.values()}) == 3, want   # each adapter changes the tokens
    served = start_server(engine.directory, tmp_path / "triton", "--max-kv-cache-tokens", "4096",
                          *[arg for name, path in adapters.items() for arg in ("--lora-modules", f"{name}={path}")])
    try:
        body = {"text_input": PROMPTS[0], "max_tokens": 12, "exclude_input_in_output": True, "end_id": -1}
        for name, extra in [(None, {}), ("sql", {"lora_name": "sql"}), ("7", {"lora_task_id": 7}),
                            ("7", {"lora_name": "7", "lora_task_id": 7})]:
            status, out = post(f"{served.http}/v2/models/kiln/generate", {**body, **extra})
            assert status == 200 and out["output_ids"] == want[name], (extra, out)
        stream = StreamClient(served.grpc)
        try:
            stream.send("sql", request(PROMPTS[0], 12, stream=tensor(True, np.bool_), end_id=tensor(-1, np.int32),
                                       lora_name=tensor("sql", np.object_)))
            stream.send("task", request(PROMPTS[0], 12, end_id=tensor(-1, np.int32), lora_task_id=tensor(7, np.uint64),
                                        exclude_input_in_output=tensor(True, np.bool_)))
            stream.wait("sql"), stream.wait("task")
            assert stream.tokens("sql") == want["sql"] and stream.tokens("task") == want["7"], stream.errors
            stream.send("unknown", request(PROMPTS[0], 4, lora_task_id=tensor(8, np.uint64)))
            stream.wait("unknown")
            assert "unknown LoRA adapter '8'" in stream.errors["unknown"], stream.errors
        finally:
            stream.close()
    finally:
        code, _ = served.stop()
    assert code == 0, served.output()[-3000:]
    assert not served.processes() and not served.shm_files()

# ---- a non-decoupled server named "ensemble", two instances, each with a small admission queue ----------
@pytest.fixture(scope="module")
def ensemble_server(engine, tmp_path_factory):
    served = start_server(engine.directory, tmp_path_factory.mktemp("triton-ensemble"),
                          "--max-kv-cache-tokens", "8192", "--no-decoupled", "--model-name", "ensemble",
                          "--instances", "2", "--max-queue-size", "2", "--max-batch-size", "2")
    yield served
    code, _ = served.stop()
    assert code == 0, served.output()[-3000:]
    assert not served.processes() and not served.shm_files()


def test_non_decoupled_infer_and_generate(ensemble_server, llm):
    ref = greedy(llm, PROMPTS[0], 10)
    client = httpclient.InferenceServerClient(ensemble_server.http.removeprefix("http://"))
    inputs = []
    for name, arr in request(PROMPTS[0], 10, exclude_input_in_output=tensor(True, np.bool_)).items():
        x = httpclient.InferInput(name, list(arr.shape), WIRE[arr.dtype])
        x.set_data_from_numpy(arr)
        inputs.append(x)
    result = client.infer("ensemble", inputs)
    assert result.as_numpy("output_ids").reshape(-1).tolist() == ref.token_ids
    assert result.as_numpy("text_output")[0, 0].decode() == ref.text
    url = f"{ensemble_server.http}/v2/models/ensemble/generate"
    status, body = post(url, {"text_input": PROMPTS[0], "max_tokens": 10})
    assert status == 200 and body["output_ids"] == ref.prompt_token_ids + ref.token_ids
    status, body = post(f"{ensemble_server.http}/v2/models/ensemble/generate",
                        {"text_input": PROMPTS[0], "max_tokens": 10, "stream": True})
    assert status == 400 and "decoupled" in body["error"]


def test_overloaded_requests_are_refused_at_once(ensemble_server, llm):
    refs = {p: greedy(llm, p, 300, ignore_eos=True) for p in PROMPTS}
    results = []

    def one(i):
        prompt = PROMPTS[i % 4]
        t0 = time.monotonic()
        status, body = post(f"{ensemble_server.http}/v2/models/ensemble/generate",
                            {"text_input": prompt, "max_tokens": 300, "end_id": -1, "exclude_input_in_output": True})
        results.append((prompt, status, body, time.monotonic() - t0))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]   # > 2 instances x (2 running + 2)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served = [(p, b) for p, s, b, _ in results if s == 200]
    refused = [(b, dt) for _, s, b, dt in results if s != 200]
    assert served and refused, results
    for prompt, body in served:
        assert body["output_ids"] == refs[prompt].token_ids
    for body, _ in refused:
        assert "overloaded" in body["error"] and "max_queue_size" in body["error"]
    slowest_served = max(dt for _, s, _, dt in results if s == 200)
    assert all(dt < slowest_served for _, dt in refused), "refusals must not wait for a slot"
    assert ensemble_server.ready()
    wait_for(lambda: metric(metrics(ensemble_server), "kiln_requests_refused_total", reason="overloaded")
             == len(refused), what="the overload counter")
    after = metrics(ensemble_server)
    for instance in ("ensemble_0_0", "ensemble_0_1"):   # each instance is its own kiln LLM
        assert metric(after, "nv_trt_llm_request_metrics", request_type="max", instance=instance) == 2
        assert metric(after, "kiln_requests_finished_total", finish_reason="length", instance=instance) > 0
        assert metric(after, "kiln_healthy", instance=instance) == 1


def test_serve_reports_a_model_that_fails_to_load(engine, tmp_path):
    broken = tmp_path / "broken-engine"
    broken.mkdir()
    shutil.copy(engine.directory / "config.json", broken / "config.json")   # no rank0.engine
    served = Served(broken, tmp_path / "serve")
    try:
        code = served.proc.wait(300)
    finally:
        served.stop()
    out = served.output()
    assert code == 1, out[-3000:]
    assert "rank0.engine" in out and "missing" in out and "the server said" in out
    assert not served.processes() and not served.shm_files()


@pytest.mark.parametrize("when", ["starting tritonserver", "Started HTTPService"])
def test_a_stop_while_tritonserver_starts_is_clean(engine, tmp_path, when):
    """SIGTERM before kiln serve has seen tritonserver ready (right as it starts it, or once Triton's HTTP is up:
    a client polling readiness itself can be served and done before kiln serve's own poll sees it) is a stop
    that was asked for: exit 0, nothing left running."""
    served = Served(engine.directory, tmp_path / "serve")
    try:
        wait_for(lambda: when in served.output(), timeout=120, what=repr(when))
    finally:
        code, _ = served.stop()
    assert code == 0, served.output()[-3000:]
    assert not served.processes() and not served.shm_files()


def test_kiln_bench_triton_target(server, engine, tmp_path):
    """kiln bench --api triton drives the session's server: every request completes with its forced length, and
    the server's numbers come from Triton's metrics port."""
    res = CliRunner().invoke(main, [
        "bench", "--endpoint", server.grpc, "--api", "triton", "--engine", str(engine.directory), "--rate", "20",
        "--num-requests", "6", "--prompt-len", "8:24", "--output-len", "12", "--metrics-url", server.metrics_url,
        "--output", str(tmp_path), "--no-plots", "--no-progress"])
    assert res.exit_code == 0, res.output
    run = json.loads((tmp_path / "result.json").read_text())["runs"][0]
    assert run["requests"]["completed"] == 6 and run["requests"]["short_outputs"] == 0
    assert all(r["output_tokens"] == 12 for r in run["per_request"])
    assert run["latency_s"]["tpot"]["count"] == 6
    assert run["server"]["kv_blocks_total"] > 0   # (counters lag: the model refreshes them once a second)


def test_launcher_tells_a_stalled_unload_from_streams_still_running(server, tmp_path):
    """The launcher's shutdown watch, on the session server's real log lines and metrics: after tritonserver says
    it unloads, a model with no request in flight and no finalize begun is stalled; one whose streams still run,
    or whose finalize began, is not."""
    watch = TritonServer(tmp_path, tmp_path, Ports(metrics=server.ports["metrics"]))
    wait_for(lambda: watch.requests_in_flight() == 0, what="an idle server")
    assert not watch.unload_stalled(0)   # not unloading yet
    watch.watch_line('I1201 08:51:56.973984 22024 server.cc:336] "All models are stopped, unloading models"')
    assert watch.unload_stalled(0) and not watch.unload_stalled(60)
    client = StreamClient(server.grpc)
    client.send("long", request(PROMPTS[0], LONG, stream=tensor(True, np.bool_), end_id=tensor(-1, np.int32)))
    try:
        # the first step of a stream waits behind the other xdist worker on 2 cores: a wide timeout
        wait_for(lambda: watch.requests_in_flight() == 1, timeout=60.0, what="the stream counted in flight")
        assert not watch.unload_stalled(0)   # the stream holds the model: Triton waits for it, rightly
    finally:
        client.close(cancel=True)
    wait_for(lambda: watch.requests_in_flight() == 0, what="the cancelled stream gone")
    watch.watch_line('I1201 08:51:57.974147 22052 model.py:242] "kiln: finalize: stopping the step loop"')
    assert not watch.unload_stalled(0)   # the model's unload began


def test_sigterm_stops_everything(server):
    """Last: it stops the session's server (one instance, requests just served) and checks what is left."""
    post(f"{server.http}/v2/models/kiln/generate", {"text_input": PROMPTS[0], "max_tokens": 8})
    assert server.processes() and server.shm_files()
    code, seconds = server.stop()
    assert code == 0 and seconds < 10, (code, seconds, server.output()[-3000:])
    assert not server.processes() and not server.shm_files()
