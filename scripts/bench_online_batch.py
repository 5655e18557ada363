"""Online + batch on one engine (not a test): online latency alone vs next to a 1000-request batch backlog.

    .venv/bin/python scripts/bench_online_batch.py --prepare     # build the engine (untimed)
    /work/tools/cpu-exclusive .venv/bin/python scripts/bench_online_batch.py [--online-requests 40]

The ~300M random Llama of the other benchmarks (``work/bench/llama-300m``) as the int8 weight-only ``cpu``
engine of ``bench_serving.py`` (batch 16, max_num_tokens 512) is served by one ``kiln serve`` process with
``--batch-store`` and ``--capacity-policy max_utilization``. Everything online goes through ``kiln bench
--endpoint`` (streaming /v1/completions, client-side TTFT/TPOT), and each command is printed:

1. the knee: ``kiln bench --max-throughput`` on --knee-requests online requests; the completion rate at
   saturation is taken as the knee rate (the rate beyond which queues grow without bound);
2. online alone: Poisson arrivals at --load (default 50%) of the knee, --online-requests requests;
3. the same online run while a 1000-line batch (``/v1/files`` + ``/v1/batches``, the lines' prompts and
   lengths like the online ones) runs on the same server: the online run starts --batch-warmup seconds after
   the first batch request runs, and the batch is cancelled after it.

Durations are scaled to a few minutes on a 2-core CPU: the batch does not finish (it is not meant to); what is
reported is its rate while the online run lasts. Targets (issue 28): online p95 TTFT and p95 TPOT with the
batch within 1.25x of alone; batch tokens/s and the total goodput (online + batch output tokens/s) against
online alone.

Outputs under ``work/bench/online-batch/``: the ``kiln bench`` result.json files and summary.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench_common import BENCH, ensure_checkpoint, ensure_engine, log

BUILD = dict(dtype="float32", quantization="int8_weight_only", backend="cpu", max_batch_size=16, max_input_len=512,
             max_seq_len=640, max_num_tokens=512, tokens_per_block=16)
KILN = str(Path(sys.executable).parent / "kiln")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_kiln(*args: str) -> None:
    log("$ kiln " + " ".join(shlex.quote(a) for a in args))
    subprocess.run([KILN, *args], check=True)


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus samples as {'name{labels}': value} (only the ones this script reads)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(kiln_(?:generation_tokens_total|class_generation_tokens_total|class_num_requests_running"
                     r"|preemptions_total|steps_total)(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def batch_lines(n: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> bytes:
    """``n`` /v1/completions lines of random token-id prompts, forced to ``output_len`` tokens."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        body = {"prompt": [rng.randrange(10, vocab) for _ in range(prompt_len)], "max_tokens": output_len,
                "temperature": 0, "ignore_eos": True}
        lines.append(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    return ("\n".join(lines) + "\n").encode()


class Server:
    """One ``kiln serve`` subprocess with a fresh batch store."""

    def __init__(self, engine: Path, store: Path, extra: list[str], threads: int):
        shutil.rmtree(store, ignore_errors=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [KILN, "serve", str(engine), "--port", str(self.port), "--batch-store", str(store),
               "--capacity-policy", "max_utilization", "--max-waiting", "4096", "--log-level", "warning", *extra]
        log("$ " + " ".join(shlex.quote(c) for c in cmd[1:]).replace(str(Path(KILN).parent) + "/", ""))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(cmd, env=env)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"kiln serve exited with {self.proc.returncode} before it served")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit("kiln serve did not become healthy in 300 s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_batch(url: str, data: bytes) -> str:
    f = httpx.post(f"{url}/v1/files", files={"file": ("backlog.jsonl", data)}, data={"purpose": "batch"}, timeout=120)
    f.raise_for_status()
    b = httpx.post(f"{url}/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/completions",
                                              "completion_window": "24h"}, timeout=60)
    b.raise_for_status()
    return b.json()["id"]


def wait_batch_steady(url: str, seconds: float, timeout: float = 300) -> None:
    """Until batch requests run, then ``seconds`` more (lines prefilled, decoding and ending: the steady state
    the online run is to meet; how many run at once depends on the shares, so no count is waited for)."""
    deadline = time.time() + timeout
    while metrics(url).get('kiln_class_num_requests_running{request_class="batch"}', 0) < 1:
        if time.time() > deadline:
            raise SystemExit(f"no batch request ran within {timeout:.0f} s")
        time.sleep(0.5)
    time.sleep(seconds)


def p95(res: dict, name: str) -> float:
    return res["runs"][0]["latency_s"][name]["p95"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true", help="build the engine, then exit")
    ap.add_argument("--prompt-len", type=int, default=128, help="online and batch prompts (tokens)")
    ap.add_argument("--output-len", type=int, default=64, help="online and batch outputs (tokens)")
    ap.add_argument("--knee-requests", type=int, default=32)
    ap.add_argument("--knee-rate", type=float, help="skip the knee run: take this req/s as the knee")
    ap.add_argument("--load", type=float, default=0.5, help="online rate as a share of the knee")
    ap.add_argument("--online-requests", type=int, default=40)
    ap.add_argument("--batch-requests", type=int, default=1000)
    ap.add_argument("--batch-warmup", type=float, default=20.0, help="seconds of batch work before the online run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra kiln serve option (repeat), e.g. --serve-arg=--batch-max-share=0.25")
    ap.add_argument("--out", type=Path, default=BENCH / "online-batch")
    args = ap.parse_args()

    ckpt = ensure_checkpoint()
    engine = ensure_engine("engine-serving-int8-b16", BUILD, ckpt)
    if args.prepare:
        return 0
    from kiln.bench.engine_facts import engine_facts

    vocab = engine_facts(engine).vocab_size
    args.out.mkdir(parents=True, exist_ok=True)
    lengths = ["--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    log(f"1-min load average before: {os.getloadavg()[0]:.2f}")
    server = Server(engine, args.out / "store", args.serve_arg, args.threads)
    try:
        common = ["bench", "--endpoint", server.url, "--engine", str(engine), *lengths, "--no-progress", "--no-plots"]
        knee = args.knee_rate
        if knee is None:
            run_kiln(*common, "--max-throughput", "--num-requests", str(args.knee_requests), "--seed", "1",
                     "--output", str(args.out / "knee"))
            res = json.loads((args.out / "knee" / "result.json").read_text())
            knee = res["runs"][0]["throughput"]["requests_per_s"]
        rate = args.load * knee
        log(f"knee {knee:.3g} req/s; online runs at {rate:.3g} req/s")
        online = [*common, "--rate", f"{rate:.4g}", "--num-requests", str(args.online_requests), "--seed", "2"]
        run_kiln(*online, "--output", str(args.out / "alone"))

        bid = start_batch(server.url, batch_lines(args.batch_requests, args.prompt_len, args.output_len, vocab, 3))
        log(f"batch {bid}: {args.batch_requests} lines; {args.batch_warmup:g} s to reach its steady state")
        wait_batch_steady(server.url, args.batch_warmup)
        m0, t0 = metrics(server.url), time.time()
        run_kiln(*online, "--output", str(args.out / "with-batch"))
        m1, t1 = metrics(server.url), time.time()
        counts = httpx.get(f"{server.url}/v1/batches/{bid}", timeout=30).json()["request_counts"]
        httpx.post(f"{server.url}/v1/batches/{bid}/cancel", timeout=60)
    finally:
        server.stop()
    log(f"1-min load average after: {os.getloadavg()[0]:.2f}")

    alone = json.loads((args.out / "alone" / "result.json").read_text())
    mixed = json.loads((args.out / "with-batch" / "result.json").read_text())
    span = t1 - t0
    online_tokens = mixed["runs"][0]["throughput"]["output_tokens_per_s"]
    gen = "kiln_generation_tokens_total"
    all_tps = (m1[gen] - m0[gen]) / span
    batch_ended = 'kiln_class_generation_tokens_total{request_class="batch"}'
    batch_tps = (m1.get(batch_ended, 0) - m0.get(batch_ended, 0)) / span
    alone_tps = alone["runs"][0]["throughput"]["output_tokens_per_s"]
    summary = {
        "date": str(datetime.date.today()), "knee_rate": knee, "online_rate": rate,
        "ttft_p95_s": {"alone": p95(alone, "ttft"), "with_batch": p95(mixed, "ttft")},
        "tpot_p95_s": {"alone": p95(alone, "tpot"), "with_batch": p95(mixed, "tpot")},
        "online_tokens_per_s": {"alone": alone_tps, "with_batch": online_tokens},
        "batch_tokens_per_s": batch_tps, "all_tokens_per_s_with_batch": all_tps,
        "batch_lines_answered_during_online_run": counts, "online_run_s": span,
        "preemptions": m1.get("kiln_preemptions_total", 0) - m0.get("kiln_preemptions_total", 0),
        "serve_args": args.serve_arg,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    ttft, tpot = summary["ttft_p95_s"], summary["tpot_p95_s"]
    print(f"\n{summary['date']} llama-300m int8 cpu engine, batch 16; prompts {args.prompt_len}, outputs "
          f"{args.output_len}; knee {knee:.3g} req/s, online {rate:.3g} req/s x {args.online_requests}; batch "
          f"{args.batch_requests} lines; serve args {args.serve_arg or 'default'}")
    print(f"{'':<22} {'alone':>9} {'with batch':>11} {'ratio':>7}")
    for name, d in (("online p95 TTFT ms", ttft), ("online p95 TPOT ms", tpot)):
        print(f"{name:<22} {d['alone'] * 1e3:>9.1f} {d['with_batch'] * 1e3:>11.1f} "
              f"{d['with_batch'] / d['alone']:>6.2f}x  (target <= 1.25x)")
    print(f"online output tok/s    {alone_tps:>9.1f} {online_tokens:>11.1f}")
    print(f"batch tok/s (ended requests' tokens over the online run): {batch_tps:.1f}; every token generated: "
          f"{all_tps:.1f} tok/s = {all_tps / alone_tps:.2f}x online alone; batch lines answered by the end: "
          f"{counts['completed']}; preemptions {summary['preemptions']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
