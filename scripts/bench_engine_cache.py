"""What kiln.LLM(checkpoint) costs the first time (build into the engine cache) and the next times (cache hit),
each in a fresh process as a user's script, and what finding the cache entry costs with and without the
remembered file digests (the cold case hashes every weight file once).

    python scripts/bench_engine_cache.py CHECKPOINT_DIR [--rounds 3] [--build '{"max_seq_len": 512}']

Uses a temporary KILN_CACHE_DIR (removed at the end). Prints seconds per phase; run it under
/work/tools/cpu-exclusive on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOAD = """
import json, sys, time
t0 = time.perf_counter()
import kiln
llm = kiln.LLM(sys.argv[1], build_config=json.loads(sys.argv[2]), max_kv_cache_tokens=1024)
t1 = time.perf_counter()
llm.generate([[5, 6, 7]], kiln.SamplingParams(max_tokens=1))
print(json.dumps({"llm_s": t1 - t0, "engine": str(llm.engine.directory)}))
"""

# the same engine directory through kiln.runtime.LLM alone: what loading costs without the on-demand layer
DIRECT = """
import json, sys, time
t0 = time.perf_counter()
from kiln.runtime import LLM, SamplingParams
llm = LLM(sys.argv[1], max_kv_cache_tokens=1024)
t1 = time.perf_counter()
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1))
print(json.dumps({"llm_s": t1 - t0}))
"""

KEY = """
import json, sys, time
from pathlib import Path
from kiln.builder import BuildConfig
from kiln.engine_cache import cache_key
build = BuildConfig(**json.loads(sys.argv[2])).resolved().to_dict()
t0 = time.perf_counter()
cache_key(Path(sys.argv[1]), build)
print(json.dumps({"key_s": time.perf_counter() - t0}))
"""


def _run(code: str, ckpt: str, build: str, env: dict) -> dict:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code, ckpt, build], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(res.stderr[-3000:])
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--build", default="{}", help="BuildConfig fields as JSON")
    args = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="kiln-cache-bench-"))
    env = {**os.environ, "KILN_CACHE_DIR": str(cache)}
    size = sum(p.stat().st_size for p in Path(args.checkpoint).iterdir() if p.is_file())
    print(f"checkpoint {args.checkpoint}: {size / 1e9:.2f} GB in its files; build {args.build}")
    try:
        first = _run(LOAD, args.checkpoint, args.build, env)
        print(f"first kiln.LLM (builds into the cache): {first['llm_s']:.2f} s (process {first['process_s']:.2f} s)")
        for r in range(args.rounds):
            hit = _run(LOAD, args.checkpoint, args.build, env)
            direct = _run(DIRECT, first["engine"], args.build, env)
            (cache / "checkpoint-digests.json").unlink()
            cold = _run(KEY, args.checkpoint, args.build, env)
            warm = _run(KEY, args.checkpoint, args.build, env)
            print(f"round {r + 1}: cached kiln.LLM {hit['llm_s']:.2f} s (process {hit['process_s']:.2f} s), "
                  f"kiln.runtime.LLM on that engine directory {direct['llm_s']:.2f} s; finding "
                  f"the entry: digests remembered {warm['key_s'] * 1e3:.1f} ms, every file hashed "
                  f"{cold['key_s'] * 1e3:.1f} ms")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
