"""kiln bench end to end: a short in-process sweep of a tiny engine, the client against the zero-latency stub,
rejections (429) and failures accounted for, compare, and the result files and plots."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kiln.bench.cli import bench
from kiln.bench.stub_server import free_port, running_stub

from runtime_support import get_engine

pytestmark = pytest.mark.xdist_group("tiny-engine")


def check_accounting(result: dict, n: int) -> None:
    for run in result["runs"]:
        req = run["requests"]
        assert req["scheduled"] == req["sent"] == n == len(run["per_request"])
        assert req["completed"] + req["failed"] + req["rejected"] + req["aborted"] == n
        assert sum(req["errors_by_kind"].values()) == n - req["completed"]
        assert {p["outcome"] for p in run["per_request"]} <= {"completed", "failed", "rejected", "aborted"}


def check_png(path) -> None:
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


@pytest.fixture(scope="module")
def tiny_engine_dir(checkpoint_dir):
    return get_engine(checkpoint_dir("llama")).directory


@pytest.fixture(scope="module")
def inprocess_result(tiny_engine_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-inproc")
    # prompts up to 110 tokens: those over the engine's max_input_len (96) must fail as invalid, and be counted
    r = CliRunner().invoke(bench, ["--engine", str(tiny_engine_dir), "--rates", "20,60", "--num-requests", "20",
                                   "--prompt-len", "8:110", "--output-len", "4:12", "--max-batch-size", "4",
                                   "--max-kv-cache-tokens", "256", "--capacity-policy", "max_utilization",
                                   "--slo-ttft-p95", "2s", "--slo-tpot-p95", "500ms", "--seed", "3",
                                   "--no-progress", "--output", str(out)])
    assert r.exit_code == 0, r.output
    return out, json.loads((out / "result.json").read_text()), r.output


def test_inprocess_sweep_accounts_for_every_request(inprocess_result):
    out, result, printed = inprocess_result
    check_accounting(result, 20)
    assert [run["rate"] for run in result["runs"]] == [20.0, 60.0]
    prompts = result["config"]["workload"]
    assert prompts["kind"] == "synthetic" and prompts["prompt_len"] == "8:110"
    for run in result["runs"]:
        req = run["requests"]
        too_long = sum(p["prompt_len"] > 96 for p in run["per_request"])
        assert too_long > 0 and req["failed"] == too_long == req["errors_by_kind"]["invalid_request"]
        assert req["completed"] == 20 - too_long and req["short_outputs"] == 0
        done = [p for p in run["per_request"] if p["outcome"] == "completed"]
        assert all(p["output_tokens"] == p["output_len"] for p in done)       # ignore_eos + min_tokens forced lengths
        assert all(p["ttft"] > 0 and p["e2e"] >= p["ttft"] for p in done)
        assert run["latency_s"]["queue"]["source"] == "per request, from the runtime"
        assert run["server"]["kv_blocks_total"] == 32                          # 256 tokens / 8 per block
        assert run["timeseries"] and 0 < run["server"]["kv_usage_max"] <= 1
    assert result["versions"]["torch"] and result["versions"]["kiln"]
    assert result["engine"]["bounds"]["max_input_len"] == 96
    assert "knee" in printed and "ok/fail/429/abort" in printed
    cal = result["calibration"]
    assert cal is None or (cal["step_fixed_s"] > 0 and cal["per_token_s"] > 0)
    for name in ("latency_vs_rate.png", "throughput_vs_rate.png", "latency_cdf.png", "kv_usage.png"):
        check_png(out / name)


def test_sweep_against_a_kiln_serve_subprocess(tiny_engine_dir, tmp_path):
    """The same short sweep through `kiln serve` (streaming completions, token-id prompts, ignore_eos and
    min_tokens honoured), with the server's /metrics polled for queue time, KV and running/waiting."""
    from test_serving_openai import API_KEY, start_server

    server = start_server(tiny_engine_dir, tmp_path / "server.log", "--max-batch-size", "4")
    try:
        r = CliRunner().invoke(bench, ["--endpoint", server.url, "--api-key", API_KEY, "--engine", str(tiny_engine_dir),
                                       "--rates", "20,60", "--num-requests", "20", "--prompt-len", "8:110",
                                       "--output-len", "4:12", "--slo-ttft-p95", "2s", "--seed", "3", "--no-progress",
                                       "--output", str(tmp_path / "out")])
    finally:
        server.stop()
    assert r.exit_code == 0, r.output
    assert server.proc.returncode == 0, server.log.read_text()[-3000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    check_accounting(result, 20)
    assert result["config"]["target"]["model"] == "tiny-llama"
    for run in result["runs"]:
        req = run["requests"]
        too_long = sum(p["prompt_len"] > 96 for p in run["per_request"])
        assert too_long > 0 and req["errors_by_kind"] == {"http_400": too_long}
        assert "max_input_len" in req["first_error_by_kind"]["http_400"]
        assert req["completed"] == 20 - too_long and req["short_outputs"] == 0
        assert run["latency_s"]["queue"]["source"] == "server /metrics histogram (bucket interpolation)"
        assert run["latency_s"]["queue"]["count"] == 20 - too_long
        assert run["server"]["steps"] > 0 and run["server"]["kv_blocks_total"] > 0
        assert run["server"]["step_time_sum"] > 0 and run["server"]["prefill_tokens"] > 0   # what calibration fits
        assert run["timeseries"] and run["queueing"]["source"] == "polled /metrics gauges"
    cal = result["calibration"]   # two rates of a tiny model may not separate step and token costs
    assert cal is None or cal["source"].startswith("per-rate /metrics deltas")
    for name in ("latency_vs_rate.png", "throughput_vs_rate.png", "latency_cdf.png", "kv_usage.png"):
        check_png(tmp_path / "out" / name)


def test_client_against_zero_latency_stub_keeps_a_fast_schedule(tmp_path):
    """The dry run: at 40 req/s (10-100x what a CPU engine serves) the client sends on time and every
    request completes; its own latency is what the stub adds, i.e. almost nothing."""
    r = CliRunner().invoke(bench, ["--dry-run", "--rates", "40", "--num-requests", "80", "--prompt-len", "32",
                                   "--output-len", "8", "--no-progress", "--no-plots", "--output", str(tmp_path)])
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "result.json").read_text())
    check_accounting(result, 80)
    run = result["runs"][0]
    assert run["requests"]["completed"] == 80
    assert run["client"]["send_rate"] > 0.8 * 40
    assert run["latency_s"]["ttft"]["p50"] < 0.1
    assert run["client"]["send_lag_s"]["count"] == 80
    assert result["config"]["target"]["kind"] == "openai"
    # the stub's /metrics (kiln serve's gauge names) was polled while the run lasted
    assert run["timeseries"] and all(s["running"] >= 0 and s["waiting"] == 0 for s in run["timeseries"])
    assert run["queueing"]["source"] == "polled /metrics gauges"


def test_kiln_serve_metric_names_map_to_the_canonical_ones():
    from kiln.bench.targets import canonical_metrics, parse_prometheus

    text = """# TYPE kiln_num_requests_running gauge
kiln_num_requests_running 3.0
# TYPE kiln_num_requests_waiting gauge
kiln_num_requests_waiting 1.0
# TYPE kiln_kv_cache_usage_ratio gauge
kiln_kv_cache_usage_ratio 0.25
# TYPE kiln_kv_cache_blocks_total gauge
kiln_kv_cache_blocks_total 64.0
# TYPE kiln_preemptions_total counter
kiln_preemptions_total 2.0
# TYPE kiln_steps_total counter
kiln_steps_total 10.0
# TYPE kiln_request_queue_time_seconds histogram
kiln_request_queue_time_seconds_bucket{le="0.1"} 4.0
kiln_request_queue_time_seconds_bucket{le="1.0"} 6.0
kiln_request_queue_time_seconds_bucket{le="+Inf"} 6.0
kiln_request_queue_time_seconds_sum 1.5
kiln_request_queue_time_seconds_count 6.0
"""
    m = canonical_metrics(parse_prometheus(text))
    assert (m["running"], m["waiting"], m["kv_usage"], m["kv_blocks_total"], m["preemptions"], m["steps"]) == \
        (3.0, 1.0, 0.25, 64.0, 2.0, 10.0)
    assert m["queue_count"] == 6.0 and m["queue_sum"] == 1.5
    assert m["queue_buckets"] == [(0.1, 4.0), (1.0, 6.0), (float("inf"), 6.0)]


def test_vllm_labelled_metrics_map_to_the_canonical_ones():
    """vLLM labels every series by engine and model_name: the series are summed over those labels (two engines
    here), a histogram's buckets keep their le."""
    from kiln.bench.targets import canonical_metrics, parse_prometheus

    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="small"} 3.0
vllm:num_requests_running{engine="1",model_name="small"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="small"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="small"} 0.5
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="small"} 7.0
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="small"} 2.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="small"} 5.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="small"} 4.5
vllm:request_queue_time_seconds_count{engine="0",model_name="small"} 5.0
"""
    m = canonical_metrics(parse_prometheus(text))
    assert (m["running"], m["waiting"], m["kv_usage"], m["preemptions"]) == (5.0, 4.0, 0.5, 7.0)
    assert m["queue_count"] == 5.0 and m["queue_sum"] == 4.5
    assert m["queue_buckets"] == [(0.3, 2.0), (float("inf"), 5.0)]


def test_rejections_and_unreachable_servers_are_counted(tmp_path):
    with running_stub(reject_every=4) as url:
        r = CliRunner().invoke(bench, ["--endpoint", url, "--vocab-size", "100", "--warmup", "0", "--rate", "50",
                                       "--num-requests", "20", "--output-len", "3", "--prompt-len", "5",
                                       "--no-progress", "--no-plots", "--output", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "a" / "result.json").read_text())
    check_accounting(result, 20)
    req = result["runs"][0]["requests"]
    assert req["rejected"] == 5 and req["errors_by_kind"] == {"http_429": 5} and req["completed"] == 15

    dead = f"http://127.0.0.1:{free_port()}"
    r = CliRunner().invoke(bench, ["--endpoint", dead, "--model", "m", "--vocab-size", "100", "--rate", "5",
                                   "--num-requests", "3", "--no-progress", "--output", str(tmp_path / "b")])
    assert r.exit_code != 0 and "warm-up request failed (connection_ConnectError" in r.output
    r = CliRunner().invoke(bench, ["--endpoint", dead, "--model", "m", "--vocab-size", "100", "--warmup", "0",
                                   "--rate", "50", "--num-requests", "3", "--no-progress", "--no-plots",
                                   "--output", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "c" / "result.json").read_text())
    check_accounting(result, 3)
    assert result["runs"][0]["requests"]["errors_by_kind"] == {"connection_ConnectError": 3}


def test_compare_and_bad_inputs(inprocess_result, tmp_path):
    out, _, _ = inprocess_result
    r = CliRunner().invoke(bench, ["compare", str(out / "result.json"), str(out / "result.json")])
    assert r.exit_code == 0, r.output
    assert "x1.00" in r.output and "TTFT p95 ms" in r.output
    bogus = tmp_path / "x.json"
    bogus.write_text("{}")
    r = CliRunner().invoke(bench, ["compare", str(out / "result.json"), str(bogus)])
    assert r.exit_code != 0 and "not a kiln bench result" in r.output
    bad_trace = tmp_path / "t.csv"
    bad_trace.write_text("timestamp,prompt_len,output_len\n0,5,1\n1,five,2\n")
    r = CliRunner().invoke(bench, ["--dry-run", "--trace", str(bad_trace), "--output", str(tmp_path / "o")])
    assert r.exit_code != 0 and "t.csv line 3: prompt_len 'five' is not an integer" in r.output
    r = CliRunner().invoke(bench, ["--dry-run", "--rate", "1", "--rates", "1,2"])
    assert r.exit_code != 0 and "choose one of --rate" in r.output


def test_clip_to_engine_makes_every_request_of_a_long_trace_fit(checkpoint_dir, tmp_path):
    """`kiln bench` and `kiln plan` with --clip-to-engine, as a user runs them, on an engine whose max_input_len
    is its max_seq_len (128) and a trace whose lengths exceed both bounds: every request completes (a prompt at
    the bound leaves room for one token) and both commands say how many were clipped."""
    engine = get_engine(checkpoint_dir("llama"), max_input_len=None).directory   # derived: max_seq_len
    assert json.loads((engine / "config.json").read_text())["bounds"]["max_input_len"] == 128
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival,prompt_len,output_len\n0,500,200\n0.1,128,5\n0.2,100,100\n0.3,10,5\n0.4,127,1\n")
    kiln = [sys.executable, "-m", "kiln.runtime.cli"]
    bench_run = subprocess.run([*kiln, "bench", "--engine", engine, "--trace", trace, "--clip-to-engine",
                                "--max-throughput", "--max-kv-cache-tokens", "512", "--no-plots", "--no-progress",
                                "--warmup", "0", "--output", tmp_path / "out"], capture_output=True, text=True,
                               timeout=300)
    assert bench_run.returncode == 0, bench_run.stdout[-3000:] + bench_run.stderr[-3000:]
    summary = "--clip-to-engine: 3 of 5 requests clipped (2 prompts to <= 127 tokens, 3 outputs to fit max_seq_len 128)"
    assert summary in bench_run.stderr
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    (run,) = result["runs"]
    assert run["requests"]["completed"] == 5 and run["requests"]["failed"] == 0, run["requests"]
    assert sorted((p["prompt_len"], p["output_len"]) for p in run["per_request"]) == \
        [(10, 5), (100, 28), (127, 1), (127, 1), (127, 1)]
    assert result["config"]["workload"]["clip"]["requests_clipped"] == 3
    plan_run = subprocess.run([*kiln, "plan", "--engine", engine, "--device", "cpu:24", "--trace", trace,
                               "--clip-to-engine", "--output", tmp_path / "plan.json"], capture_output=True, text=True,
                              timeout=300)
    assert plan_run.returncode == 0, plan_run.stdout[-3000:] + plan_run.stderr[-3000:]
    assert summary in plan_run.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["clip"]["requests_clipped"] == 3
