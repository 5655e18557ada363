"""kiln plan --pd: prefill and decode workers for a trace, a rate and an SLO, against colocated instances. On a
synthetic trace the plan moves the expected way: longer prompts take more prefill workers, longer outputs more
decode workers, a slower transport adds its transfer time to TTFT; bad inputs are refused with what to give."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from kiln.bench.plan_cli import plan as plan_cmd

LLAMA_8B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                tie_word_embeddings=False, torch_dtype="bfloat16")
SLO = ["--rate", "20", "--ttft-p95", "2s", "--tpot-p95", "50ms"]


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama8b") / "config.json"
    path.write_text(json.dumps(LLAMA_8B))
    return path


def trace(path, prompt: int, output: int, n: int = 200, seed: int = 3):
    """A synthetic trace: Poisson arrivals, lengths uniform within +-25 % of ``prompt`` and ``output``."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.05, n))
    p = rng.integers(int(prompt * 0.75), int(prompt * 1.25) + 1, n)
    o = rng.integers(int(output * 0.75), int(output * 1.25) + 1, n)
    path.write_text("arrival,prompt_len,output_len\n" + "".join(f"{a:.4f},{x},{y}\n" for a, x, y in zip(t, p, o)))
    return path


def pd_plan(hf_config, tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    r = CliRunner().invoke(plan_cmd, ["--hf-config", str(hf_config), "--device", "h100-80gb", *args,
                                      "--output", str(out)])
    assert r.exit_code == 0, r.output
    assert "PD plan at 20 req/s" in r.output and "recommended: P=" in r.output
    return json.loads(out.read_text())["plan"]["pd"]


def test_longer_prompts_take_prefill_workers_longer_outputs_decode_workers(hf_config, tmp_path):
    base, long_prompts, long_outputs = (
        pd_plan(hf_config, tmp_path, name, "--trace", str(trace(tmp_path / f"{name}.csv", p, o)), *SLO, "--pd",
                "--transfer-bandwidth", "10")
        for name, p, o in (("base", 2000, 200), ("long_prompts", 8000, 200), ("long_outputs", 2000, 800)))
    b, lp, lo = (x["recommended"] for x in (base, long_prompts, long_outputs))
    for rec in (b, lp, lo):
        assert rec["meets_slo"] and rec["ttft_p95_s"] <= 2 and rec["tpot_s"] <= 0.05
    assert lp["config"] != b["config"] and lo["config"] != b["config"]
    # the role whose work grew gets more workers, and a larger share of them
    assert lp["workers"] > b["workers"] and lp["config"].startswith("P=") and _p(lp) > _p(b)
    assert _p(lp) / lp["workers"] > _p(b) / b["workers"]
    assert _d(lo) > _d(b) and _d(lo) / lo["workers"] > _d(b) / b["workers"]
    # the recommendation is the fewest workers: every split with one worker less misses the SLO
    for pd in (base, long_prompts, long_outputs):
        rec = pd["recommended"]
        fewer = [r for r in pd["table"] if not r["config"].startswith("colocated") and r["workers"] < rec["workers"]]
        assert (len(fewer) > 0) == (rec["workers"] > 2) and not any(r["meets_slo"] for r in fewer)
        colo = [r for r in pd["table"] if r["config"] == f"colocated x{rec['workers']}"]
        assert len(colo) == 1 and pd["colocated_instances"] >= 1


def _p(rec: dict) -> int:
    return int(rec["config"].split()[0].removeprefix("P="))


def _d(rec: dict) -> int:
    return int(rec["config"].split()[1].removeprefix("D="))


def test_transfer_time_is_blocks_times_bytes_over_bandwidth_and_adds_to_ttft(hf_config, tmp_path):
    path = str(trace(tmp_path / "t.csv", 2000, 200))
    fast, slow = (pd_plan(hf_config, tmp_path, f"bw{bw}", "--trace", path, *SLO, "--pd", "--transfer-bandwidth", bw,
                          "--pd-max-workers", "8")
                  for bw in ("10", "1"))
    per_block = 32 * 2 * 8 * 128 * 2 * 16   # layers x K,V x KV heads x head_dim x bf16 x tokens per block
    assert fast["transport"]["bytes_per_block"] == slow["transport"]["bytes_per_block"] == per_block
    f = next(r for r in fast["table"] if r["config"] == "P=1 D=1")
    s = next(r for r in slow["table"] if r["config"] == "P=1 D=1")
    p95 = float(np.percentile([int(x.split(",")[1]) for x in open(path).read().split()[1:]], 95))
    assert f["transfer_p95_s"] == pytest.approx(math.ceil(p95 / 16) * per_block / 10e9)
    assert s["transfer_p95_s"] == pytest.approx(10 * f["transfer_p95_s"])
    assert s["ttft_p95_s"] - f["ttft_p95_s"] == pytest.approx(s["transfer_p95_s"] - f["transfer_p95_s"])
    assert s["tpot_s"] == f["tpot_s"]   # decode steps do not wait on transfers


@pytest.mark.parametrize("args, message", [
    (["--pd"], "--pd-transfer"),
    (["--pd", "--transfer-bandwidth", "0"], "must be > 0"),
    (["--transfer-bandwidth", "10"], "go with --pd"),
    (["--pd", "--transfer-bandwidth", "10", "--rate", "5"], "needs an SLO"),
    (["--pd", "--transfer-bandwidth", "10", "--ttft-p95", "2s"], "needs --rate"),
])
def test_bad_pd_inputs_say_what_to_give(hf_config, args, message):
    r = CliRunner().invoke(plan_cmd, ["--hf-config", str(hf_config), "--device", "h100-80gb", "--context-p95", "2000",
                                      "--output-p95", "200", *args])
    assert r.exit_code != 0 and message in r.output, r.output
