"""The Triton frontend in disaggregated mode: `kiln serve --frontend triton ENGINE --prefill-workers 2
--decode-workers 1` runs the bundled tritonserver whose Python-backend model is a frontend over prefill and decode
worker processes (the same model, the same tensors). Greedy outputs over gRPC streaming and HTTP /generate equal
kiln's colocated LLM; Triton's metrics endpoint carries the KV transfer and prefix-routing counters; SIGTERM leaves
no worker behind. What the mode cannot be combined with is refused before anything is written."""

from __future__ import annotations

import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.cli import main
from kiln.runtime.disagg.config import DisaggConfig
from kiln.serving.triton.repository import RepoOptions, parameters, read_disagg

from runtime_support import random_prompts

if find_spec("pytriton") is None or find_spec("tritonclient") is None:
    pytest.skip("the triton extra is not installed (pip install 'kiln-llm[triton]')", allow_module_level=True)

from test_serving_triton import StreamClient, metric, metrics, post, start_server, tensor  # noqa: E402

pytestmark = [pytest.mark.xdist_group("triton"), pytest.mark.usefixtures("hang_watchdog")]

VOCAB = 512


def test_triton_repo_refuses_what_the_pd_mode_cannot_serve(llama_engine, tmp_path):
    runner = CliRunner()
    out = tmp_path / "repo"
    engine = str(llama_engine.directory)
    cases = {
        ("--prefill-workers", "1", "--instances", "2"): "1 with prefill_workers > 0",
        ("--prefill-workers", "1", "--lora-modules", f"a={tmp_path}"): "serves no LoRA adapters yet",
        ("--prefill-workers", "1", "--decode-workers", "0"): "decode_workers must be an integer >= 1",
        ("--worker-listen", "127.0.0.1:7100"): "worker_listen needs prefill_workers",
        ("--prefill-workers", "1", "--transfer-timeout", "0"): "transfer_timeout must be > 0",
    }
    for args, expected in cases.items():
        res = runner.invoke(main, ["triton-repo", engine, "-o", str(out), *args])
        assert res.exit_code != 0 and expected in res.output, (args, res.output)
        assert not out.exists(), f"{args}: something was written"
    res = runner.invoke(main, ["triton-repo", engine, "-o", str(out), "--prefill-workers", "2",
                               "--worker-threads", "1", "--transfer-timeout", "5"])
    assert res.exit_code == 0, res.output
    config = (out / "kiln" / "config.pbtxt").read_text()
    assert 'key: "prefill_workers"\n  value: { string_value: "2" }' in config
    assert 'key: "worker_listen"\n  value: { string_value: "" }' in config
    # what the model reads back; a repository rendered before the mode existed serves colocated
    disagg = DisaggConfig(prefill_workers=2, decode_workers=3, worker_threads=1, transfer_timeout=5.0)
    assert read_disagg(parameters(RepoOptions(disagg=disagg), engine)) == disagg
    assert read_disagg({"engine_dir": engine}) == DisaggConfig()


def worker_pids(engine_dir: Path) -> list[int]:
    """Live disaggregated workers serving ``engine_dir`` (their command line names it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
                if b"kiln.runtime.disagg" in cmd and str(engine_dir).encode() in cmd \
                        and (entry / "stat").read_text().split()[2] != "Z":
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_the_pd_model_serves_like_the_colocated_llm(llama_engine, tmp_path):
    """Streams over gRPC (prompts as input_ids, four sharing a 40-token prefix, sent one after another so the
    prefix is cached when the next arrives) and a text prompt over HTTP /generate: the colocated LLM's greedy
    tokens and text. Triton's metrics count every prompt's KV transfer, both prefill workers alive and the
    requests routed to a cached prefix; after SIGTERM the server exits 0 with no worker left."""
    shared = random_prompts(1, VOCAB, 40, 40, seed=60)[0]
    prompts = [shared + p for p in random_prompts(4, VOCAB, 3, 9, seed=61)] + random_prompts(2, VOCAB, 5, 60, seed=62)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(llama_engine) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
        text = llm.generate(["The kiln fires the clay"], SamplingParams(temperature=0, max_tokens=8))[0].text
    server = start_server(llama_engine.directory, tmp_path, "--prefill-workers", "2", "--decode-workers", "1",
                          "--worker-threads", "1", "--max-kv-cache-tokens", "2048")
    try:
        assert len(worker_pids(llama_engine.directory)) == 3
        stream = StreamClient(server.grpc)
        try:
            for i, p in enumerate(prompts):
                stream.send(f"r{i}", {"input_ids": tensor(p, np.int32), "input_lengths": tensor(len(p), np.int32),
                                      "max_tokens": tensor(12, np.int32), "ignore_eos": tensor(True, np.bool_),
                                      "stream": tensor(True, np.bool_)})
                stream.wait(f"r{i}")
                assert f"r{i}" not in stream.errors, stream.errors
        finally:
            stream.close()
        assert [stream.tokens(f"r{i}") for i in range(len(prompts))] == expected
        status, body = post(f"{server.http}/v2/models/kiln/generate",
                            {"text_input": "The kiln fires the clay", "max_tokens": 8,
                             "exclude_input_in_output": True})
        assert status == 200 and body["text_output"] == text, body
        deadline = time.monotonic() + 10   # the metrics are refreshed about once a second
        while True:
            m = metrics(server)
            if metric(m, "kiln_kv_transfers_total") >= len(prompts) + 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert metric(m, "kiln_kv_transfers_total") == len(prompts) + 1
        assert metric(m, "kiln_kv_transfer_bytes_total") > 0
        assert metric(m, "kiln_disagg_workers_alive", role="prefill") == 2
        assert metric(m, "kiln_disagg_workers_alive", role="decode") == 1
        assert metric(m, "kiln_disagg_prefix_routed_total") >= 3   # the 2nd..4th shared-prefix prompts
        assert metric(m, "kiln_healthy") == 1
    finally:
        code, _ = server.stop()
    assert code == 0, server.output()[-3000:]
    deadline = time.monotonic() + 10
    while worker_pids(llama_engine.directory) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not worker_pids(llama_engine.directory)
    assert not server.processes() and not server.shm_files()
