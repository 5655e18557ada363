"""kiln bench compare: one workload against a launched kiln serve and the zero-latency stub (no vLLM needed), with
startup and idle RSS measured, the servers stopped after their runs, and hostile target specifications refused."""

from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner

from kiln.bench.cli import bench
from kiln.bench.compare import CompareError, TargetSpec, launch, parse_targets, tree_rss_bytes
from kiln.bench.stub_server import free_port

from runtime_support import get_engine

pytestmark = pytest.mark.xdist_group("tiny-engine")


@pytest.fixture(scope="module")
def compared(checkpoint_dir, tmp_path_factory):
    engine = get_engine(checkpoint_dir("llama")).directory
    out = tmp_path_factory.mktemp("compare")
    kp, sp = free_port(), free_port()
    kiln_cmd = f"{sys.executable} -m kiln.runtime.cli serve {engine} --port {kp} --log-level warning"
    stub_cmd = f"{sys.executable} -m kiln.bench.stub_server --port {sp}"
    r = CliRunner().invoke(bench, [
        "--engine", str(engine), "--rates", "4,8", "--num-requests", "6", "--prompt-len", "8:40",
        "--output-len", "4:8", "--slo-ttft-p95", "5s", "--slo-tpot-p95", "1s", "--seed", "1", "--no-progress",
        "--output", str(out), "compare", "--target", f"kiln=http://127.0.0.1:{kp}",
        "--target", f"stub=http://127.0.0.1:{sp}", "--launch", f"kiln={kiln_cmd}", "--launch", f"stub={stub_cmd}",
        "--startup-timeout", "300"])
    assert r.exit_code == 0, r.output
    return out, r.output, (kp, sp)


def test_compare_runs_both_targets_side_by_side(compared):
    out, printed, ports = compared
    for name in ("kiln", "stub"):
        result = json.loads((out / name / "result.json").read_text())
        assert [run["rate"] for run in result["runs"]] == [4.0, 8.0]
        assert all(run["requests"]["completed"] == 6 for run in result["runs"])
        proc = result["server_process"]
        assert proc["startup_s"] > 0 and proc["idle_rss_bytes"] > 10 * 2**20   # a Python server's tree
        assert result["config"]["target"]["name"] == name
    extras = json.loads((out / "compare.json").read_text())["extras"]
    assert extras["kiln"]["startup_s"] > extras["stub"]["startup_s"] * 0.5   # loading an engine is not free
    text = (out / "compare.txt").read_text()
    for needle in ("knee rate", "goodput at own knee", "startup s", "idle RSS MiB", "TTFT p95 ms", "TPOT p95 ms"):
        assert needle in text and needle in printed
    assert "(x" in text   # the stub's ratios to kiln
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # both servers were stopped: their ports take connections no more
    import httpx

    for port in ports:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1.0)


def test_compare_reads_result_files(compared):
    out, _, _ = compared
    r = CliRunner().invoke(bench, ["compare", str(out / "kiln" / "result.json"), str(out / "stub" / "result.json")])
    assert r.exit_code == 0, r.output
    assert "TTFT p95 ms" in r.output and "goodput at own knee" in r.output


@pytest.mark.parametrize("args, message", [
    ((), "needs a --target"),
    (("kiln=http://a:1", "kiln=http://b:2"), "given twice"),
    (("kiln=ftp://a:1", "v=http://b:2"), "must start with http"),
    (("http://a:1", "v=http://b:2"), "NAME=VALUE"),
])
def test_bad_targets_are_refused(args, message):
    with pytest.raises(CompareError, match=message):
        parse_targets(args)


def test_bad_launch_and_pid_are_refused():
    t = ("a=http://127.0.0.1:1", "b=http://127.0.0.1:2")
    with pytest.raises(CompareError, match="no --target of that name"):
        parse_targets(t, launches=("c=true",))
    with pytest.raises(CompareError, match="must be an integer"):
        parse_targets(t, pids=("a=12x",))
    with pytest.raises(CompareError, match="not both"):
        parse_targets(t, launches=("a=sleep 1",), pids=("a=1",))
    specs = parse_targets(t, launches=("a=python -m x --port 9",), pids=(f"b={os.getpid()}",))
    assert specs[0].command == ["python", "-m", "x", "--port", "9"] and specs[1].pid == os.getpid()


def test_a_server_that_dies_or_never_answers_is_reported(tmp_path):
    port = free_port()
    dead = TargetSpec("dead", f"http://127.0.0.1:{port}", [sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(CompareError, match="exited with status 3"):
        launch(dead, 30, tmp_path / "dead.log")
    mute = TargetSpec("mute", f"http://127.0.0.1:{port}", [sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(CompareError, match="did not answer within 1 s"):
        launch(mute, 1, tmp_path / "mute.log")
    missing = TargetSpec("missing", f"http://127.0.0.1:{port}", ["/nonexistent/kiln-server"])
    with pytest.raises(CompareError, match="cannot start"):
        launch(missing, 1, tmp_path / "missing.log")


def test_tree_rss_counts_children_and_missing_pids():
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        import time

        deadline = time.monotonic() + 20
        while tree_rss_bytes(child.pid) < 64 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        mine, tree = tree_rss_bytes(child.pid), tree_rss_bytes(os.getpid())
        assert mine >= 64 << 20 and tree >= mine    # this process's tree includes the child
    finally:
        child.kill()
        child.wait()
    assert tree_rss_bytes(child.pid) is None
