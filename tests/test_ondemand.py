"""kiln.LLM(checkpoint) and `kiln serve CHECKPOINT_DIR`, as a user runs them (fresh processes): the checkpoint
is built once into the engine cache (progress shown), the second run loads the cached engine without building
(and says so), the served model answers the official openai client; the cache key follows content, build
config and versions; errors name what is wrong; `import kiln.runtime` still imports no builder."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

import kiln
from kiln.builder import BuildConfig
from kiln.contract import ConfigError, EngineLoadError
from kiln.engine_cache import cache_key, checkpoint_files
from kiln.serving.cli import serve

from runtime_support import hf_greedy

pytestmark = pytest.mark.xdist_group("ondemand")

BUILD = {"max_seq_len": 128, "max_batch_size": 4, "max_num_tokens": 128, "tokens_per_block": 8}
PROMPT = [5, 6, 7, 8, 9]

SCRIPT = """
import json, sys
import kiln

llm = kiln.LLM(sys.argv[1], build_config=json.loads(sys.argv[2]), max_kv_cache_tokens=512)
out = llm.generate([json.loads(sys.argv[3])], kiln.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
print("TOKENS", json.dumps(out[0].token_ids), "ENGINE", llm.engine.directory, flush=True)
"""

# threads of this process that are not Python threads (OpenMP workers among them) before and after a build
NATIVE_THREADS_AROUND_BUILD = """
import json, os, sys, threading, time
import torch
from kiln.ondemand import resolve_engine

def native_threads():
    return len(set(map(int, os.listdir("/proc/self/task"))) - {t.native_id for t in threading.enumerate()})

before = native_threads()
engine = resolve_engine(sys.argv[1], json.loads(sys.argv[2]))
deadline = time.monotonic() + 10   # a thread's OpenMP workers exit in its destructors, just after it ends
while native_threads() > before and time.monotonic() < deadline:
    time.sleep(0.05)
print("THREADS", before, native_threads(), engine)
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kiln-cache")


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "KILN_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}


def _run_script(ckpt: Path, cache: Path, tmp_path: Path) -> tuple[list[int], Path, str]:
    script = tmp_path / "first_10_minutes.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(ckpt), json.dumps(BUILD), json.dumps(PROMPT)],
                         capture_output=True, text=True, timeout=600, env=_env(cache), cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("TOKENS")]
    tokens, engine = line.removeprefix("TOKENS ").split(" ENGINE ")
    return json.loads(tokens), Path(engine), res.stderr


def test_llm_builds_a_checkpoint_once_then_loads_it_from_the_cache(checkpoint_dir, cache, tmp_path):
    ckpt = checkpoint_dir("llama")
    tokens, engine, log = _run_script(ckpt, cache, tmp_path)
    assert tokens == hf_greedy(ckpt, PROMPT, 6, ignore_eos=True)
    assert engine.parent == cache and engine.name.startswith(f"{ckpt.name}-")
    assert f"kiln: building an engine for {ckpt} into the cache ({engine};" in log
    assert "[2/7] trace" in log and "[7/7] write done in" in log and "engine built in" in log   # its progress
    build = json.loads((engine / "config.json").read_text())["build"]
    assert {k: build[k] for k in BUILD} == BUILD and build["max_input_len"] == 128
    built_at = (engine / "config.json").stat().st_mtime_ns

    again, engine2, log2 = _run_script(ckpt, cache, tmp_path)
    assert again == tokens and engine2 == engine
    assert f"kiln: using the cached engine {engine} for {ckpt} (no build)" in log2
    assert "building" not in log2 and "trace" not in log2
    assert (engine / "config.json").stat().st_mtime_ns == built_at
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [engine.name]


def test_building_into_the_cache_leaves_the_calling_thread_without_an_openmp_team(checkpoint_dir, tmp_path):
    """The build runs torch's and kiln's parallel kernels; on the calling thread (which then serves the engine)
    they would leave it an OpenMP team for the process's life, and a second team makes every parallel region of
    the step loop sleep and wake (`kiln serve CHECKPOINT` decoded at half the speed of a server whose engine came
    from the cache). The build's thread and its team end with the build: as many threads after it as before."""
    res = subprocess.run([sys.executable, "-c", NATIVE_THREADS_AROUND_BUILD, str(checkpoint_dir("llama")),
                          json.dumps(BUILD)], capture_output=True, text=True, timeout=600, env=_env(tmp_path / "cache"),
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("THREADS")]
    before, after, engine = line.split()[1:]
    assert Path(engine).parent == tmp_path / "cache"   # built now, not found in a cache
    assert int(after) == int(before), f"{int(after) - int(before)} native thread(s) left behind by the build"


def test_kiln_serve_a_checkpoint_with_build_flags(checkpoint_dir, cache, tmp_path):
    """`kiln serve CHECKPOINT_DIR` + build flags after it: the engine of the same checkpoint and build (from the
    cache of the test above, or built now), served under the checkpoint's name, answering the openai client."""
    ckpt = checkpoint_dir("llama")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in BUILD.items()]
    cmd = [sys.executable, "-m", "kiln.runtime.cli", "serve", str(ckpt), *flags, "--port", "0",
           "--max-kv-cache-tokens", "512"]
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(cache))
    try:
        deadline = time.monotonic() + 300
        while not (m := re.search(r"listening on (http://\S+) ", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{m.group(1)}/v1", api_key="none")
        assert [model.id for model in client.models.list()] == [ckpt.name]
        out = client.completions.create(model=ckpt.name, prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert f"for {ckpt} (no build)" in text or f"building an engine for {ckpt}" in text, text[-3000:]
    (engine,) = [p for p in cache.iterdir() if p.is_dir()]   # the same entry as kiln.LLM's
    assert f"kiln serve: loading {engine}" in text


def test_the_cache_key_follows_content_build_config_and_versions(checkpoint_dir, tmp_path, monkeypatch):
    ckpt = Path(shutil.copytree(checkpoint_dir("gpt2"), tmp_path / "ckpt"))
    cache = tmp_path / "cache"
    build = BuildConfig(**BUILD).resolved().to_dict()
    key = cache_key(ckpt, build, cache)
    assert key == cache_key(ckpt, build, cache)
    assert key == cache_key(ckpt, BuildConfig(**BUILD, max_input_len=128).resolved().to_dict(), cache)  # same engine
    assert key != cache_key(ckpt, BuildConfig(**{**BUILD, "dtype": "bfloat16"}).resolved().to_dict(), cache)
    names = [p.name for p in checkpoint_files(ckpt)]
    assert "config.json" in names and "model.safetensors" in names and "tokenizer.json" in names
    (ckpt / "README.md").write_text("not read by the build")
    assert cache_key(ckpt, build, cache) == key
    os.utime(ckpt / "model.safetensors")            # touched, same bytes: hashed again, same key
    assert cache_key(ckpt, build, cache) == key
    weights = bytearray((ckpt / "model.safetensors").read_bytes())
    weights[-1] ^= 1                                 # one bit of one weight
    (ckpt / "model.safetensors").write_bytes(bytes(weights))
    changed = cache_key(ckpt, build, cache)
    assert changed != key
    monkeypatch.setattr("torch.__version__", "9.9.9")
    assert cache_key(ckpt, build, cache) != changed


def test_options_and_directories_are_checked_before_building(checkpoint_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = checkpoint_dir("llama")
    with pytest.raises(ConfigError, match=r"LLM: unknown option 'max_batch_sise' \(did you mean 'max_batch_size'\?\)"):
        kiln.LLM(ckpt, max_batch_sise=2)
    with pytest.raises(ConfigError, match="'build_config'"):
        kiln.LLM(ckpt, build_confg={})
    with pytest.raises(ConfigError, match=r"unknown key 'max_seqlen' \(did you mean 'max_seq_len'\?\)"):
        kiln.LLM(ckpt, build_config={"max_seqlen": 64})
    with pytest.raises(ConfigError, match="no such directory; give an engine directory"):
        kiln.LLM(tmp_path / "nowhere")
    assert not (tmp_path / "cache").exists() or not any(p.is_dir() for p in (tmp_path / "cache").iterdir())
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"format_version": 5}))
    with pytest.raises(ConfigError, match="is an engine directory, already built"):
        kiln.LLM(engine, build_config={"dtype": "bfloat16"})
    res = CliRunner().invoke(serve, [str(engine), "--dtype", "bfloat16", "--max-batch-size", "2"])
    assert res.exit_code == 2 and "--dtype: build flags apply to a Hugging Face checkpoint directory" in res.output
    # the runtime's own LLM names a checkpoint for what it is
    from kiln.runtime import LLM as RuntimeLLM

    with pytest.raises(EngineLoadError, match=r"is a Hugging Face checkpoint, not an engine: kiln\.LLM"):
        RuntimeLLM(ckpt)


def test_import_kiln_runtime_imports_no_builder():
    upstream = ("kiln.builder", "kiln.ondemand", "kiln.model_defs")
    code = (f"import sys, kiln.runtime, kiln.serving.openai.app; "
            f"print(sorted(m for m in sys.modules if m.startswith({upstream!r})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
