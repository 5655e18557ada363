"""kiln bench against a disaggregated `kiln serve` (1 prefill + 1 decode worker): each rate reports the KV bytes
moved (= blocks x bytes per block, one transfer per completed request), the wire time per request, the TTFT split
and the queue per role, from the server's /metrics; the printed report says so too. A colocated page has none."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kiln.bench.cli import bench
from kiln.bench.disagg import from_samples, rate_section
from kiln.bench.targets import canonical_metrics, parse_prometheus

from runtime_support import get_engine

pytestmark = [pytest.mark.xdist_group("disagg"), pytest.mark.usefixtures("hang_watchdog")]


def test_bench_reports_kv_transfer_and_ttft_split_of_a_pd_server(checkpoint_dir, tmp_path):
    from test_serving_openai import API_KEY, start_server

    engine = get_engine(checkpoint_dir("llama"))
    server = start_server(engine.directory, tmp_path / "server.log", "--prefill-workers", "1", "--decode-workers",
                          "1", "--worker-threads", "1", "--max-batch-size", "4")
    try:
        r = CliRunner().invoke(bench, ["--endpoint", server.url, "--api-key", API_KEY, "--engine",
                                       str(engine.directory), "--rates", "8", "--num-requests", "12",
                                       "--prompt-len", "8:80", "--output-len", "4:8", "--seed", "5", "--no-progress",
                                       "--no-plots", "--output", str(tmp_path / "out")])
    finally:
        server.stop()
    assert r.exit_code == 0, r.output
    run = json.loads((tmp_path / "out" / "result.json").read_text())["runs"][0]
    done = [p for p in run["per_request"] if p["outcome"] == "completed"]
    assert len(done) == 12
    d = run["disagg"]
    bs = engine.config.bounds.tokens_per_block
    blocks = sum(-(-p["prompt_len"] // bs) for p in done)
    assert d["transfers"] == 12 and d["transfers_failed"] == 0 and d["kv_transfer_blocks"] == blocks
    assert d["kv_transfer_bytes"] == blocks * bs * engine.kv_bytes_per_token
    assert d["transfer_time_s"]["count"] == 12 and d["transfer_time_s"]["p95"] > 0
    assert d["ttft_prefill_s"]["count"] == 12 and d["ttft_transfer_s"]["count"] == 12
    assert 0 < d["ttft_prefill_s"]["mean"] < max(p["ttft"] for p in done) + 1
    # in flight per role, from request-seconds (no poll needed): each request is in prefill from its arrival to its
    # first token on the prefill worker (or later) and in decode after, all within the client's e2e
    qp, qd = d["queue_prefill"], d["queue_decode"]
    assert qp["request_seconds"] >= d["ttft_prefill_s"]["mean"] * 12 * 0.99 > 0 and qd["request_seconds"] > 0
    assert qp["request_seconds"] + qd["request_seconds"] <= sum(p["e2e"] for p in done)
    assert qp["mean"] == pytest.approx(qp["request_seconds"] / d["window_s"]) and qp["max_read"] >= 0
    assert "PD rate 8.0: KV moved" in r.output and "TTFT split" in r.output
    # kiln plan --pd takes the transport from this result: bytes per block and bandwidth as measured
    from kiln.bench.plan_cli import plan as plan_cmd

    p = CliRunner().invoke(plan_cmd, ["--engine", str(engine.directory), "--device", "cpu:24", "--context-p95", "80",
                                      "--output-p95", "8", "--rate", "2", "--ttft-p95", "5s", "--pd", "--pd-transfer",
                                      str(tmp_path / "out" / "result.json"), "--output", str(tmp_path / "plan.json")])
    assert p.exit_code == 0, p.output
    t = json.loads((tmp_path / "plan.json").read_text())["plan"]["pd"]["transport"]
    assert t["bytes_per_block"] == bs * engine.kv_bytes_per_token
    wire = d["transfer_time_s"]["mean"] * d["transfer_time_s"]["count"]
    assert t["bandwidth_bytes_per_s"] == pytest.approx(d["kv_transfer_bytes"] / wire)


def test_a_colocated_page_has_no_pd_numbers():
    page = "# TYPE kiln_steps_total counter\nkiln_steps_total 10.0\n"
    m = canonical_metrics(parse_prometheus(page))
    assert from_samples(parse_prometheus(page)) == {} and rate_section({}, m, [], 1.0) is None


def test_pd_deltas_are_per_rate():
    def page(n: int, secs: float) -> str:
        return (f"kiln_kv_transfers_total {n}\nkiln_kv_transfer_bytes_total {n * 1000}\n"
                f"kiln_kv_transfer_blocks_total {n * 2}\nkiln_kv_transfers_failed_total 0\n"
                f'kiln_kv_transfer_seconds_bucket{{le="0.01"}} {n}\nkiln_kv_transfer_seconds_bucket{{le="+Inf"}} {n}\n'
                f"kiln_kv_transfer_seconds_sum {secs}\nkiln_kv_transfer_seconds_count {n}\n"
                f'kiln_disagg_requests{{role="prefill"}} 1\nkiln_disagg_requests{{role="decode"}} {n // 4}\n'
                f'kiln_disagg_request_seconds_total{{role="prefill"}} {n}\n'
                f'kiln_disagg_request_seconds_total{{role="decode"}} {3 * n}\n')
    before, after = (canonical_metrics(parse_prometheus(page(n, s))) for n, s in ((4, 0.02), (10, 0.05)))
    d = rate_section(before, after, [{"disagg_queue_decode": 3}, {"disagg_queue_decode": 1}], 3.0)
    assert d["transfers"] == 6 and d["kv_transfer_bytes"] == 6000 and d["bytes_per_request"] == 1000
    assert d["transfer_time_s"]["count"] == 6 and d["transfer_time_s"]["mean"] == pytest.approx(0.005)
    assert 0 < d["transfer_time_s"]["p95"] <= 0.01
    assert d["queue_decode"] == {"mean": 6.0, "max_read": 3, "request_seconds": 18.0}   # 18 s over 3 s
    assert d["queue_prefill"] == {"mean": 2.0, "max_read": 1, "request_seconds": 6.0}
