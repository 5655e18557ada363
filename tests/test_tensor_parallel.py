"""Tensor parallelism on CPU with gloo: TP=2 engines against their TP=1 twins (logits over a mixed packed step
sequence) and transformers (greedy outputs of 24 concurrent requests) for every family, an MQA model (its
one KV head replicated) in fp32 and int8; the runtime around a TP engine (preemption, chunked prefill,
prefix reuse, seeded sampling, `kiln generate`, `kiln inspect`, `kiln serve`, torchrun); a worker killed
mid-generation; missing and mismatched rank files.

The TP=2 engines are loaded once (each spawns one worker process) and shared by the tests of this module,
which run in one xdist group; each is closed when the module ends.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from click.testing import CliRunner

from kiln.builder import BuildConfig, build_engine
from kiln.builder.cli import build_engine_cmd
from kiln.contract import EngineDeadError, EngineInputError, EngineLoadError, ExecutorClosedError
from kiln.runtime import LLM, Engine, SamplingParams
from kiln.runtime.cli import main as kiln_main

from paged_batch import PagedBatcher
from runtime_support import hf_greedy, random_prompts

pytestmark = [pytest.mark.xdist_group("tp"), pytest.mark.usefixtures("hang_watchdog")]

VOCAB = 512
BUILD = BuildConfig(max_batch_size=16, max_input_len=96, max_seq_len=128, max_num_tokens=128, tokens_per_block=8,
                    gather_all_logits=True)
# case -> (family, checkpoint overrides): every family with its special feature (conftest), and MQA
CASES = {"llama": ("llama", {}), "mistral": ("mistral", {}), "qwen2": ("qwen2", {}), "gpt2": ("gpt2", {}),
         "mqa": ("llama", {"num_key_value_heads": 1}),
         # the 2026 families: a dense one (q/k norms replicated, per-layer windows and rotary bases) and an MoE one
         # (every expert's intermediate dim split, the router replicated)
         "gemma3": ("gemma3", {}), "qwen3_moe": ("qwen3_moe", {})}
FP32_ATOL = 1e-4


@pytest.fixture(scope="module")
def engines(checkpoint_dir, tmp_path_factory):
    """engines(case, tp, **build changes) -> Engine, built and loaded once; TP engines closed at the end."""
    loaded: dict[tuple, Engine] = {}

    def get(case: str, tp: int, **changes) -> Engine:
        key = (case, tp, tuple(sorted(changes.items())))
        if key not in loaded:
            family, overrides = CASES[case]
            out = tmp_path_factory.mktemp(f"tp{tp}-{case}") / "engine"
            build_engine(checkpoint_dir(family, **overrides), out, BUILD.replace(tp_size=tp, **changes))
            loaded[key] = Engine.from_dir(out)
        return loaded[key]

    yield get
    for engine in loaded.values():
        engine.close()


def ckpt_of(checkpoint_dir, case: str) -> Path:
    family, overrides = CASES[case]
    return checkpoint_dir(family, **overrides)


# (seq, new tokens) per step: packed prefills, a late prefill beside decodes, a second chunk with a context
# offset, decodes; context entries first, as the contract says
SCHEDULE = [[("a", 13), ("b", 6)], [("c", 9), ("a", 1), ("b", 1)], [("b", 5), ("a", 1), ("c", 1)],
            [("a", 1), ("b", 1), ("c", 1)]]


def schedule_logits(engine: Engine, seed: int = 1) -> list[torch.Tensor]:
    """Logits of every position of SCHEDULE, step by step (the same tokens for every engine)."""
    rng = random.Random(seed)
    done: dict[str, int] = {}
    tokens = {s: [rng.randrange(3, VOCAB) for _ in range(40)] for s in "abc"}
    bs = engine.config.bounds.tokens_per_block
    batcher = PagedBatcher(engine.config.rank_model, 64, bs, kv_cache=engine.allocate_kv_cache(64))
    out = []
    for step in SCHEDULE:
        batch = [(s, tokens[s][done.get(s, 0):done.get(s, 0) + n]) for s, n in step]
        for s, n in step:
            done[s] = done.get(s, 0) + n
        out.append(engine.run(batcher.step(batch, all_logits=True)))
    return out


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def child_pids(pid: int) -> set[int]:
    """Live (not zombie) processes whose parent is ``pid``."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(d.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return f"pid {pid} (gone)"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_logits_match_tp1(case, engines):
    tp1, tp2 = engines(case, 1), engines(case, 2)
    m = tp2.config.tensor_parallel
    assert tp2.config.tp_size == 2 and tp2.config.engine_files == ["rank0.engine", "rank1.engine"]
    assert m.kv_head_replicas == (2 if case == "mqa" else 1) and m.num_heads_per_rank == 2
    assert tp2.config.kv_bytes_per_token == tp1.config.kv_bytes_per_token // (1 if case == "mqa" else 2)
    err = max_diff(schedule_logits(tp2), schedule_logits(tp1))
    print(f"\n{case}: TP=2 vs TP=1 max abs logit difference {err:.2e}")
    assert err <= FP32_ATOL, f"{case}: {err}"
    report = json.loads((tp2.directory / "build_report.json").read_text())
    ranks = report["tensor_parallel"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["weights_bytes"] == ranks[1]["weights_bytes"]
    # per rank: q/k/v merged into one GEMM and gate/up into one, as with one rank
    assert report["gemms"] == json.loads((tp1.directory / "build_report.json").read_text())["gemms"]


@pytest.mark.parametrize("case", list(CASES))
def test_24_concurrent_greedy_requests_match_transformers(case, engines, checkpoint_dir):
    engine = engines(case, 2)
    rng = random.Random(7)
    prompts = random_prompts(24, VOCAB, 1, 60, seed=11)
    max_tokens = [rng.randint(1, 16) for _ in prompts]
    with LLM(engine) as llm:
        outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])
        biggest = max(s.batch_size for s in llm.executor.metrics.steps)
    ckpt = ckpt_of(checkpoint_dir, case)
    bad = [f"request {i}: kiln {o.token_ids} != hf {ref}" for i, (p, m, o) in enumerate(zip(prompts, max_tokens, outs))
           if o.token_ids != (ref := hf_greedy(ckpt, p, m))]
    assert not bad, "\n".join(bad)
    assert biggest >= 8, "requests were not batched"


def test_cpu_compiled_tp2_engine_matches_tp1(engines):
    """The collectives survive AOTInductor: a compiled package calls kiln::all_reduce / all_gather back."""
    tp1, aoti = engines("llama", 1), engines("llama", 2, backend="cpu-compiled")
    assert aoti.config.backend == "cpu-compiled"
    err = max_diff(schedule_logits(aoti), schedule_logits(tp1))
    assert err <= FP32_ATOL, err


def test_int8_mqa_quantizes_each_shard(engines):
    """Weight-only int8 runs per shard (the row-parallel GEMMs get per-channel scales of their half of the
    input): the TP=2 int8 engine is as close to fp32 as the TP=1 int8 engine is."""
    fp = schedule_logits(engines("mqa", 1))
    q1 = engines("mqa", 1, quantization="int8_weight_only")
    q2 = engines("mqa", 2, quantization="int8_weight_only")
    e1, e2 = max_diff(schedule_logits(q1), fp), max_diff(schedule_logits(q2), fp)
    print(f"\nMQA int8 vs fp32: TP=1 {e1:.4f}, TP=2 {e2:.4f} max abs logit error")
    assert 0 < e2 <= 1.5 * e1 + 1e-3, (e1, e2)
    passes = json.loads((q2.directory / "build_report.json").read_text())["passes"]
    layers = q2.config.model.num_layers
    assert passes["weight_only_quant"]["quantized_gemms"] == 4 * layers + 1   # qkv, o, gate_up, down + lm_head
    assert "each of the 1 replicated on 2 ranks" in dict(_inspect_rows(q2.directory))["tensor parallel"]


@pytest.mark.parametrize("case", ["llama", "mqa"])
def test_int8_kv_each_rank_quantizes_its_heads(case, engines):
    """An int8 KV pool per rank (its KV heads, or the replicated one): TP=2 gives the TP=1 int8 engine's logits
    up to keys an ulp apart rounding to neighbouring int8 numbers, far closer than either is to the fp32 pool."""
    fp, q1, q2 = engines(case, 1), engines(case, 1, kv_cache_dtype="int8"), engines(case, 2, kv_cache_dtype="int8")
    assert q2.kv_dtype == torch.int8
    assert q2.config.kv_bytes_per_token == q1.config.kv_bytes_per_token // (1 if case == "mqa" else 2)
    one = schedule_logits(q1)
    err, quant_err = max_diff(schedule_logits(q2), one), max_diff(one, schedule_logits(fp))
    print(f"\n{case} int8 KV: TP=2 vs TP=1 {err:.2e}, TP=1 int8 vs fp32 pool {quant_err:.2e}")
    assert err <= 0.25 * quant_err, (err, quant_err)
    accuracy = [json.loads((e.directory / "build_report.json").read_text())["kv_cache_accuracy"] for e in (q1, q2)]
    assert accuracy[0]["positions"] > 0 and "tensor-parallel build" in accuracy[1]["skipped"]


def _inspect_rows(directory: Path) -> list[tuple[str, str]]:
    res = CliRunner().invoke(kiln_main, ["inspect", str(directory)])
    assert res.exit_code == 0, res.output
    return [tuple(p.strip() for p in line.split("|", 1)) for line in res.output.splitlines() if "|" in line]


# ------------------------------------------------------------------------------------------ the runtime
def test_preemption_chunked_prefill_and_prefix_reuse(engines, checkpoint_dir):
    engine = engines("llama", 2)
    ckpt = ckpt_of(checkpoint_dir, "llama")
    rng = random.Random(3)
    prefix = [rng.randrange(3, VOCAB) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    longest = max(len(p) for p in prompts) + 16
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(engine, capacity_policy="max_utilization", max_kv_cache_tokens=longest + 24, max_num_tokens=16) as llm:
        outs = llm.generate(prompts[:1], greedy) + llm.generate(prompts[1:], greedy)
        stats = llm.stats()
        assert all(s.prefill_tokens + s.decode_tokens <= 16 for s in llm.executor.metrics.steps)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ckpt, p, 16, ignore_eos=True)
    assert stats["counters"]["preemptions"] > 0 and stats["kv_cache"]["prefix_hits"] > 0


def test_seeded_sampling_is_the_same_with_one_or_two_ranks(engines):
    prompts = random_prompts(6, VOCAB, 5, 40, seed=5)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, seed=i) for i in range(6)]
    got = []
    for tp in (1, 2):
        with LLM(engines("qwen2", tp)) as llm:
            got.append([o.token_ids for o in llm.generate(prompts, params)])
    assert got[0] == got[1]


def test_a_replaced_pool_is_refused(engines):
    engine = engines("gpt2", 2)
    old = engine.allocate_kv_cache(8)
    inputs = PagedBatcher(engine.config.rank_model, 8, 8, kv_cache=old).step([("a", [5, 6, 7])])
    engine.allocate_kv_cache(8)
    with pytest.raises(EngineInputError, match="not the pool this engine's last allocate_kv_cache returned"):
        engine.run(inputs)


def test_generate_and_inspect_clis(engines):
    directory = engines("llama", 2).directory
    rows = dict(_inspect_rows(directory))
    assert rows["tensor parallel"].startswith("2 ranks, each: 2 heads, 1 KV head(s), MLP 64, LM head 256 vocab rows")
    assert rows["weights"].endswith(" per rank") and rows["KV bytes/token"].endswith("over 2 ranks)")
    before = child_pids(os.getpid())
    res = CliRunner().invoke(kiln_main, ["generate", "--engine", str(directory), "--prompt", "The kiln fires",
                                         "--prompt", "Tokens flow", "--max-tokens", "6", "--ignore-eos"])
    assert res.exit_code == 0, res.output
    assert res.output.count("[6 tokens, length") == 2
    assert child_pids(os.getpid()) == before, "kiln generate left its worker running"


def test_build_engine_refuses_a_tp_size_the_heads_do_not_allow(checkpoint_dir, tmp_path):
    res = CliRunner().invoke(build_engine_cmd, ["--checkpoint", str(checkpoint_dir("gpt2")), "--output",
                                                str(tmp_path / "e"), "--tp-size", "3"])
    assert res.exit_code != 0
    assert "tp_size=3 does not divide num_heads=4" in res.output and "[1, 2, 4]" in res.output
    assert not (tmp_path / "e").exists()


def test_kiln_serve_with_a_tp_engine(engines, tmp_path):
    """The OpenAI server over a TP engine: greedy completions equal LLM.generate's on the TP=1 engine; SIGTERM
    stops the server and its worker."""
    tp1, tp2 = engines("llama", 1), engines("llama", 2)
    prompts = random_prompts(3, VOCAB, 4, 20, seed=9)
    with LLM(tp1) as llm:
        want = [o.text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "kiln.runtime.cli", "serve", str(tp2.directory), "--port", "0", "--log-level",
           "warning"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"listening on (http://\S+) ", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        children = child_pids(proc.pid)   # its worker
        assert sum("kiln.runtime.tp_worker" in cmdline(c) for c in children) == 1, [cmdline(c) for c in children]
        for p, text in zip(prompts, want):
            r = httpx.post(f"{m.group(1)}/v1/completions", timeout=60, json={
                "model": tp2.directory.name, "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
        assert httpx.get(f"{m.group(1)}/health", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log.read_text()
    assert "kiln serve: stopped" in log.read_text()
    # the worker is joined before the server exits; multiprocessing's resource tracker (a child too) only
    # notices its parent is gone when its pipe closes, a moment later
    deadline = time.monotonic() + 10
    while (left := [c for c in children if alive(c)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the server outlived it by 10 s: {[cmdline(c) for c in left]}"


# ------------------------------------------------------------------------------------------ failures
def test_a_worker_killed_mid_generation_fails_the_requests_within_seconds(engines):
    directory = engines("gpt2", 2).directory
    before = child_pids(os.getpid())
    llm = LLM(directory)   # its own engine: its own worker, which this test kills
    try:
        (worker,) = llm.engine.worker_pids
        outs: list = []
        ids = [llm.submit(p, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), callback=outs.append)
               for p in random_prompts(8, VOCAB, 4, 30, seed=2)]
        deadline = time.monotonic() + 60
        while sum(len(o.token_ids) for o in outs) < 8:
            assert time.monotonic() < deadline, "no tokens came"
            time.sleep(0.01)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        assert llm.executor.wait_idle(10), "requests still running 10 s after the worker died"
        took = time.monotonic() - killed
        final = [o for o in outs if o.finished]
        assert sorted(o.request_id for o in final) == sorted(ids)
        assert all(o.error and "rank 1" in o.error and "SIGKILL" in o.error for o in final), final[0].error
        with pytest.raises(ExecutorClosedError, match="rank 1"):
            llm.submit([5, 6, 7])
        assert "rank 1" in llm.executor.failure
        with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 \(pid \d+\) died \(killed by SIGKILL\)"):
            llm.engine.allocate_kv_cache(4)
        print(f"\nrequests failed {took:.2f} s after the worker was killed")
    finally:
        llm.shutdown()
    assert not alive(worker) and child_pids(os.getpid()) == before


def test_a_hung_worker_fails_the_step_after_the_collective_timeout(engines, monkeypatch):
    monkeypatch.setenv("KILN_TP_TIMEOUT_S", "2")   # read by both ranks when their groups are formed
    directory = engines("gpt2", 2).directory
    before = child_pids(os.getpid())
    llm = LLM(directory)
    try:
        (worker,) = llm.engine.worker_pids
        os.kill(worker, signal.SIGSTOP)   # alive, but answering nothing
        t0 = time.monotonic()
        with pytest.raises(ExecutorClosedError, match=r"step failed on rank 0 .*after 2 s \(KILN_TP_TIMEOUT_S\)"):
            llm.generate([5, 6, 7], SamplingParams(max_tokens=4))
        assert time.monotonic() - t0 < 10
    finally:
        llm.shutdown()
    assert not alive(worker) and child_pids(os.getpid()) == before


def test_missing_or_mismatched_rank_files_are_named(engines, tmp_path, monkeypatch):
    src = engines("gpt2", 2).directory
    before = child_pids(os.getpid())
    missing = Path(shutil.copytree(src, tmp_path / "missing"))
    (missing / "rank1.engine").unlink()
    with pytest.raises(EngineLoadError, match=r"missing/rank1\.engine: missing; the engine directory is incomplete"):
        Engine.from_dir(missing)
    swapped = Path(shutil.copytree(src, tmp_path / "swapped"))
    shutil.copy(swapped / "rank0.engine", swapped / "rank1.engine")
    with pytest.raises(EngineLoadError, match=r"swapped/rank1\.engine: checksum mismatch"):   # every rank checksummed
        LLM(swapped)
    # without the checksums (KILN_SKIP_ENGINE_CHECKSUM=1) the rank stamps still name the file
    monkeypatch.setenv("KILN_SKIP_ENGINE_CHECKSUM", "1")
    with pytest.raises(EngineLoadError, match=r"missing/rank1\.engine: missing \(rank 1 of 2\)"):
        Engine.from_dir(missing)
    with pytest.raises(EngineLoadError, match=r"swapped/rank1\.engine: holds rank 0 of 2 .* expects rank 1 of 2"):
        LLM(swapped)
    assert child_pids(os.getpid()) == before   # refused before any worker started


TORCHRUN_SCRIPT = """
import json, sys
from kiln.runtime import LLM, SamplingParams

llm = LLM(sys.argv[1])   # rank 1 serves inside this call and exits when rank 0 shuts down
prompts = json.loads(sys.argv[2])
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print("TOKENS", json.dumps([o.token_ids for o in outs]), flush=True)
llm.shutdown()
"""


def test_torchrun_ranks_join_as_leader_and_worker(engines, checkpoint_dir, tmp_path):
    directory = engines("qwen2", 2).directory
    script = tmp_path / "serve_tp.py"
    script.write_text(TORCHRUN_SCRIPT)
    prompts = random_prompts(4, VOCAB, 3, 30, seed=4)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(directory), json.dumps(prompts)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("TOKENS")]
    got = json.loads(line.removeprefix("TOKENS"))
    ckpt = ckpt_of(checkpoint_dir, "qwen2")
    assert got == [hf_greedy(ckpt, p, 8, ignore_eos=True) for p in prompts]


# A user's script as users write it: no __main__ guard, no shutdown (the worker is a fresh interpreter on kiln's
# entry point, so nothing re-imports the script); the same body under a guard; and the body as `python -c`.
USER_SCRIPT = """
import json, os, sys
from kiln.runtime import LLM, SamplingParams

llm = LLM(sys.argv[1])
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
print("TOKENS", json.dumps(out[0].token_ids), "WORKERS", json.dumps(llm.engine.worker_pids), flush=True)
"""


@pytest.mark.parametrize("form", ["script without a guard", "script with a guard", "python -c"])
def test_a_users_script_starts_the_workers_in_every_form(form, engines, checkpoint_dir, tmp_path):
    directory = engines("gpt2", 2).directory
    if form == "python -c":
        cmd = [sys.executable, "-c", USER_SCRIPT, str(directory)]
    else:
        body = USER_SCRIPT
        if form == "script with a guard":
            body = "if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in USER_SCRIPT.splitlines())
        script = tmp_path / "my_script.py"
        script.write_text(body)
        cmd = [sys.executable, str(script), str(directory)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "while starting" not in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("TOKENS")]
    tokens, workers = (json.loads(x) for x in line.removeprefix("TOKENS ").split(" WORKERS "))
    assert tokens == hf_greedy(ckpt_of(checkpoint_dir, "gpt2"), [5, 6, 7, 8], 6, ignore_eos=True)
    assert len(workers) == 1 and not alive(workers[0]), "the worker outlived the script"
