"""Single-stream decode of kiln and its peers against the machine's read bandwidth of the moment (not a test).

    python scripts/peers_single_bound.py $PEERS_DIR [--rounds 6] [--classes fp32,bf16,int8,int4]

Batch-1 decode streams every weight except the embedding table once per token, so its ceiling is
streamed bytes / read rate, and that rate drifts on this shared VM (40-65 GB/s from minute to minute): one
engine measured a minute after another can look 25% faster or slower. So this script alternates the engines of
a class round after round, each in its own process (the peers' scripts of ``../shared/peers``, like
``run_all_with_kiln.sh``), and measures the 2-thread streaming read rate right before and after each run. Per run
it prints tok/s, the GB/s that implies (tok/s x streamed bytes) and that as a share of the read rate around it;
per class the median of each engine's share and of the paired ratios kiln / peer. An engine at ~100% of the
read rate cannot be beaten by 1.2x by anything that streams the same bytes.

Expects the peers' scripts in ``../shared/peers`` (or ``$PEERS_SCRIPTS``) and the layout ``run_all_with_kiln.sh``
builds under PEERS_DIR (venv, models/small, gguf_out, onnx, kiln).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PEERS = Path(os.environ.get("PEERS_SCRIPTS", Path(__file__).resolve().parents[2] / "shared" / "peers"))
READ_RATE = ("import sys; sys.path.insert(0, {scripts!r}); from bench_common import stream_read_bandwidth as b; "
             "print(b(256 << 20, 3, 2))")


def streamed_params(model_dir: Path) -> int:
    """Weights a decode token reads: every linear layer and the LM head (not the embedding, of which it
    gathers one row)."""
    c = json.loads((model_dir / "config.json").read_text())
    h, ffn, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    head = c.get("head_dim") or h // c["num_attention_heads"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * head
    return layers * (2 * h * h + 2 * h * kv + 3 * h * ffn) + vocab * h


def engines(peers_dir: Path, kiln_py: str) -> dict[str, list[tuple[str, float, list[str]]]]:
    """class -> [(name, bytes per streamed weight, command)], kiln first."""
    py, s = str(peers_dir / "venv" / "bin" / "python"), PEERS
    kiln = lambda name: [kiln_py, str(s / "bench_kiln.py"), str(peers_dir / "kiln" / f"small-{name}")]  # noqa: E731
    llama = lambda q: [py, str(s / "bench_llamacpp.py"), str(peers_dir / "gguf_out" / f"small-{q}.gguf")]  # noqa: E731
    return {
        "fp32": [("kiln fp32-compiled", 4.0, kiln("fp32-compiled")), ("llama.cpp f32", 4.0, llama("f32")),
                 ("onnxruntime-genai fp32", 4.0,
                  [py, str(s / "bench_ortgenai.py"), str(peers_dir / "onnx" / "small_fp32")])],
        "bf16": [("kiln bf16-compiled", 2.0, kiln("bf16-compiled")), ("llama.cpp bf16", 2.0, llama("bf16"))],
        # kiln int8: one byte + a fp32 scale per 1024-wide row (~1.0); q8_0: 34 bytes per 32 weights
        "int8": [("kiln int8-compiled", 1.0, kiln("int8-compiled")), ("llama.cpp q8_0", 34 / 32, llama("q8_0"))],
        # kiln int4 panels: half a byte + an fp16 scale per 128 weights; q4_0: 18 bytes per 32 weights
        "int4": [("kiln int4-compiled", 0.5 + 2 / 128, kiln("int4-compiled")),
                 ("llama.cpp q4_0", 18 / 32, llama("q4_0"))],
    }


def read_rate(kiln_py: str) -> float:
    code = READ_RATE.format(scripts=str(Path(__file__).resolve().parent))
    return float(subprocess.run([kiln_py, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])


def decode_tok_s(cmd: list[str], prompts: Path) -> tuple[float | None, str]:
    """(decode tok/s, "") of one single-stream run, or (None, the last line it wrote to stderr)."""
    env = dict(os.environ, THREADS="2", OMP_NUM_THREADS="2")
    proc = subprocess.run(cmd + [str(prompts), "single"], capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][7:])["decode_tok_s"], ""
    return None, (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peers_dir", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--classes", default="fp32,bf16,int8,int4")
    ap.add_argument("--kiln-python", default=sys.executable)
    args = ap.parse_args()
    if not (PEERS / "bench_kiln.py").is_file():
        ap.error(f"the peers' scripts are not in {PEERS}: set PEERS_SCRIPTS to the shared/peers folder")
    params = streamed_params(args.peers_dir / "models" / "small")
    table = engines(args.peers_dir, args.kiln_python)
    classes = args.classes.split(",")
    runs: dict[str, dict[int, tuple[float, float]]] = {}   # engine -> round -> (tok/s, share of the read rate)
    print(f"streamed weights per token: {params / 1e6:.1f} M; read rate: 2 threads, 256 MiB, best of 3, "
          "before and after each run (mean)")
    after = read_rate(args.kiln_python)
    for r in range(args.rounds):
        for cls in classes:
            for name, bytes_per, cmd in table[cls]:
                before = after   # one measurement between two runs serves both
                tok_s, error = decode_tok_s(cmd, args.peers_dir / "prompts.json")
                after = read_rate(args.kiln_python)
                rate = (before + after) / 2
                if tok_s is None:
                    print(f"round {r + 1} {name}: failed: {error}")
                    continue
                gbs = tok_s * params * bytes_per / 1e9
                runs.setdefault(name, {})[r] = (tok_s, gbs / rate)
                print(f"round {r + 1} {name:24} {tok_s:7.1f} tok/s  {gbs:5.1f} GB/s  read {rate:5.1f} GB/s  "
                      f"{100 * gbs / rate:4.0f}% of it", flush=True)
    print("\nmedians over rounds (paired: kiln / peer in the same round)")
    for cls in classes:
        kiln_name = table[cls][0][0]
        for name, _, _ in table[cls]:
            got = list(runs.get(name, {}).values())
            if not got:
                continue
            line = (f"{name:24} {statistics.median(t for t, _ in got):7.1f} tok/s  "
                    f"{100 * statistics.median(s for _, s in got):4.0f}% of the read rate")
            if name != kiln_name and runs.get(kiln_name):
                ratios = [k[0] / runs[name][r][0] for r, k in runs[kiln_name].items() if r in runs[name]]
                line += f"   kiln / this: x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
