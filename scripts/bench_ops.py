"""Plugin op benchmark (not a test): per-call time of the norm / rotary / activation / paged attention
ops, and the decode step time of an engine, now vs a baseline.

    .venv/bin/python scripts/bench_ops.py [--baseline REV] [--variants fp32,bf16] [--steps 30] [--threads 2]
                                          [--context 128]

Columns:
  native    the ops as they are (C++ CPU kernels, plugins/csrc/plugin_ops.cpp)
  torch     the same ops with the native kernels disabled (KILN_DISABLE_NATIVE_KERNELS=1 path:
            plain Library ops with Python kernels)
  baseline  the plugins package of git revision REV (e.g. the custom_op version), loaded in a
            subprocess from ``git archive REV plugins`` in place of kiln.plugins
Shapes are the ~300M Llama's (hidden 1024, 16 heads / 4 kv heads of 64, MLP 2816) at decode, batch 1
and 16, each sequence with ``--context`` tokens of context (128 by default). The engine part runs decode steps of
``work/bench/engine-builder-<variant>`` (built by scripts/bench_build.py; built here if missing).
Timings on a shared 2-core machine are noisy: compare the columns of one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_plugins_from(rev: str, tmp: Path) -> None:
    """Import kiln.plugins from ``git archive rev plugins`` (must run before anything imports it)."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "plugins"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=data, check=True)
    import kiln

    spec = importlib.util.spec_from_file_location(
        "kiln.plugins", tmp / "plugins" / "__init__.py", submodule_search_locations=[str(tmp / "plugins")]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kiln.plugins"] = mod
    spec.loader.exec_module(mod)
    kiln.plugins = mod


def per_call_us(fn, calls: int = 100, repeats: int = 3) -> float:
    from bench_common import best_per_call_s  # scripts/ is on sys.path (main)

    return best_per_call_s(fn, calls, repeats, warmup=20) * 1e6


def op_cases(batch: int, dtype, context: int = 128):
    import torch

    from kiln.plugins.rotary import cos_sin_table, rope_inv_freq

    ops = torch.ops.kiln
    hidden, heads, kv_heads, head_dim, inter, block = 1024, 16, 4, 64, 2816, 16
    x = torch.randn(batch, hidden).to(dtype)
    w = torch.randn(hidden).to(dtype)
    q = torch.randn(batch, heads, head_dim).to(dtype)
    k = torch.randn(batch, kv_heads, head_dim).to(dtype)
    v = torch.randn(batch, kv_heads, head_dim).to(dtype)
    table = cos_sin_table(2048, rope_inv_freq(head_dim, 10000.0, None))
    pos = torch.full((batch,), context, dtype=torch.int64)
    g, u = torch.randn(batch, inter).to(dtype), torch.randn(batch, inter).to(dtype)
    per_seq = (context + 1 + block - 1) // block
    kv = torch.randn(2, 2, per_seq * batch, block, kv_heads, head_dim).to(dtype)
    tables = torch.arange(per_seq * batch, dtype=torch.int32).view(batch, per_seq)
    slots = tables[:, context // block].long() * block + context % block
    lens, ctx = torch.ones(batch, dtype=torch.int32), torch.full((batch,), context + 1, dtype=torch.int32)
    return {
        "rms_norm": lambda: ops.rms_norm(x, w, 1e-6),
        "fused_add_rms_norm": lambda: ops.fused_add_rms_norm(x, x, w, 1e-6),
        "rotary_embedding": lambda: ops.rotary_embedding(q, k, pos, table),
        "silu_mul": lambda: ops.silu_mul(g, u),
        "gelu": lambda: ops.gelu(g, "tanh"),
        "paged_attention": lambda: ops.paged_attention(q, k, v, kv, 1, lens, ctx, tables, slots, 0.125, 0),
    }


def engine_step_ms(variant: str, batch: int, steps: int) -> float:
    sys.path.insert(0, str(ROOT / "scripts"))
    from kiln.runtime import Engine

    import bench_build as bb
    from bench_common import engine_is_current

    path = bb.engine_dir(variant)
    if not engine_is_current(path, bb.build_config(variant).to_dict()):
        bb.build(variant, bb.ensure_checkpoint())
    engine = Engine.from_dir(path)
    inputs = bb.decode_inputs(engine, batch)
    for _ in range(3):
        engine.run(inputs)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.run(inputs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(args, modes: list[str]) -> dict:
    """{mode: {"ops": {f"{op} b{batch} {dtype}": us}, "engine": {f"{variant} b{batch}": ms}}}"""
    import torch

    torch.set_num_threads(args.threads)
    import kiln.plugins  # noqa: F401

    res = {}
    for mode in modes:
        ctx = None
        if mode == "torch":
            from kiln.plugins.native import native_kernels_disabled

            ctx = native_kernels_disabled()
            ctx.__enter__()
        r = {"ops": {}, "engine": {}}
        for dtype in (torch.float32, torch.bfloat16):
            for batch in (1, 16):
                for name, fn in op_cases(batch, dtype, args.context).items():
                    r["ops"][f"{name} b{batch} {str(dtype)[6:]}"] = per_call_us(fn)
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if mode != "torch" and args.variants:  # the torch mode would also disable the linear kernels
            for variant in args.variants.split(","):
                for batch in (1, 16):
                    r["engine"][f"{variant} b{batch}"] = engine_step_ms(variant, batch, args.steps)
        res[mode] = r
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="git revision whose plugins/ to compare with (e.g. the custom_op version)")
    ap.add_argument("--variants", default="fp32,bf16", help="engines to time ('' for none)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128, help="tokens of context of each sequence in the op cases")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:  # baseline run in a subprocess: print the JSON only
        with tempfile.TemporaryDirectory() as tmp:
            load_plugins_from(args._child, Path(tmp))
            print(json.dumps(measure(args, ["baseline"])))
        return

    res = {}
    if args.baseline:
        cmd = [sys.executable, __file__, "--_child", args.baseline, "--variants", args.variants,
               "--steps", str(args.steps), "--threads", str(args.threads), "--context", str(args.context)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        res.update(json.loads(out.strip().splitlines()[-1]))
    res.update(measure(args, ["native", "torch"]))
    modes = [m for m in ("baseline", "torch", "native") if m in res]
    baseline = f"; baseline = plugins/ of {args.baseline}" if args.baseline else ""
    print(f"per-call time (us), {args.threads} threads, context {args.context}{baseline}")
    print(f"{'op':<34}" + "".join(f"{m:>10}" for m in modes) + (f"{'speedup':>9}" if "baseline" in res else ""))
    for key in res["native"]["ops"]:
        row = f"{key:<34}" + "".join(f"{res[m]['ops'][key]:>10.1f}" for m in modes)
        if "baseline" in res:
            row += f"{res['baseline']['ops'][key] / res['native']['ops'][key]:>8.1f}x"
        print(row)
    if res["native"]["engine"]:
        emodes = [m for m in ("baseline", "native") if res[m]["engine"]]
        print()
        print(f"engine decode step, median of {args.steps} (ms), context 128")
        print(f"{'engine':<34}" + "".join(f"{m:>10}" for m in emodes))
        for key in res["native"]["engine"]:
            print(f"{key:<34}" + "".join(f"{res[m]['engine'][key]:>10.2f}" for m in emodes))


if __name__ == "__main__":
    main()
