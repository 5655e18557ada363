"""Device check for the onnx and tensorrt backends (run on a machine with an NVIDIA GPU; a CPU works too).

    python scripts/device_check_onnx_trt.py ONNX_ENGINE_DIR [--plan TENSORRT_ENGINE_DIR] [--steps 20]

Self-contained (numpy + onnxruntime; torch and TensorRT optional; kiln need not be installed): it reads the
engine directory's config.json, packs a mixed step (a prefill chunk after cached tokens, a fresh prompt,
decodes) the way kiln's contract does, and

1. reports the GPU (torch.cuda, nvidia-smi) and onnxruntime's available execution providers;
2. runs the onnx engine with the CPU execution provider and, when available, the CUDA one, and compares
   the logits and the updated KV pool (CUDA vs CPU); on CUDA it also binds the pool output to the pool
   input's own device buffer (what kiln's runtime does on the CPU) and checks that gives the same pool;
   times decode steps on each provider;
3. reports which parts of the TensorRT path can run: import tensorrt / tensorrt_rtx, and deserializing the
   plan of --plan, only where a GPU is visible (creating a TensorRT runtime without one can crash).

Every missing piece is reported, never fatal. Prints a report and writes it to $OUT/report.json if OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

REPORT: dict = {"python": sys.version.split()[0]}
BLOCK_IDS = {"a": [5, 9, 2], "b": [7], "c": [11, 12, 13], "d": [20]}


def note(key: str, value) -> None:
    REPORT[key] = value
    print(f"{key}: {json.dumps(value, default=str)[:600]}", flush=True)


def guarded(key: str):
    """Run the decorated step; an exception is recorded under ``key`` and the check goes on."""
    def wrap(fn):
        def run(*a, **k):
            try:
                return fn(*a, **k)
            except Exception as exc:  # noqa: BLE001 - a device check reports, it does not stop
                note(key, {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]})
                return None
        return run
    return wrap


@guarded("gpu")
def check_gpu() -> bool:
    info: dict = {}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            free, total = torch.cuda.mem_get_info()
            info["memory_gib"] = {"free": round(free / 2**30, 1), "total": round(total / 2**30, 1)}
    except ImportError as exc:
        info["torch"] = f"not importable ({exc})"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["nvidia_smi"] = f"unavailable ({exc})"
    note("gpu", info)
    return bool(info.get("cuda_available")) or "NVIDIA" in str(info.get("nvidia_smi", ""))


def pack_step(config: dict) -> dict[str, np.ndarray]:
    """A mixed step: 'a' 7 new tokens after 5 cached, 'b' a 4-token prompt, 'c' and 'd' one token each."""
    m, bs = config["model"], config["bounds"]["tokens_per_block"]
    rng = np.random.default_rng(0)
    chunks = [("a", 5, 7), ("b", 0, 4), ("c", 9, 1), ("d", 2, 1)]
    ids, pos, slots, seq_lens, ctx, logits = [], [], [], [], [], []
    width = max(len(b) for b in BLOCK_IDS.values())
    tables = []
    for name, start, n in chunks:
        blocks = BLOCK_IDS[name]
        ids += rng.integers(3, m["vocab_size"], n).tolist()
        pos += list(range(start, start + n))
        slots += [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
        seq_lens.append(n)
        ctx.append(start + n)
        logits += list(range(len(ids) - n, len(ids)))   # every row: a stronger comparison
        tables.append(blocks + [0] * (width - len(blocks)))
    num_blocks = 32
    kv_dtype = {"float32": np.float32, "float16": np.float16}.get(config["kv_cache_dtype"], np.float32)
    kv = rng.standard_normal((m["num_layers"], 2, num_blocks, bs, m["num_kv_heads"], m["head_dim"])).astype(kv_dtype)
    return {
        "input_ids": np.array(ids, np.int64), "position_ids": np.array(pos, np.int64),
        "seq_lens": np.array(seq_lens, np.int32), "context_lens": np.array(ctx, np.int32),
        "block_tables": np.array(tables, np.int32), "slot_mapping": np.array(slots, np.int64),
        "logits_indices": np.array(logits, np.int64), "kv_cache": kv,
    }


def decode_step(config: dict, batch: int = 8) -> dict[str, np.ndarray]:
    m, bs = config["model"], config["bounds"]["tokens_per_block"]
    context = min(64, config["bounds"]["max_seq_len"] - 1)
    per = (context + 1 + bs - 1) // bs
    kv = np.zeros((m["num_layers"], 2, per * batch, bs, m["num_kv_heads"], m["head_dim"]), np.float32)
    tables = np.arange(per * batch, dtype=np.int32).reshape(batch, per)
    return {"input_ids": np.full(batch, 5, np.int64), "position_ids": np.full(batch, context, np.int64),
            "seq_lens": np.ones(batch, np.int32), "context_lens": np.full(batch, context + 1, np.int32),
            "block_tables": tables, "slot_mapping": (tables[:, context // bs] * bs + context % bs).astype(np.int64),
            "logits_indices": np.arange(batch, dtype=np.int64), "kv_cache": kv}


@guarded("onnxruntime")
def check_onnx(engine_dir: Path, steps: int, gpu: bool) -> None:
    import onnxruntime as ort

    providers = ort.get_available_providers()
    note("onnxruntime", {"version": ort.__version__, "available_providers": providers, "device": ort.get_device()})
    config = json.loads((engine_dir / "config.json").read_text())
    model_path = str(engine_dir / config["engine_files"][0])
    if config["backend"] != "onnx":
        note("onnx_engine", {"error": f"{engine_dir} is a {config['backend']} engine, not onnx"})
        return
    step = pack_step(config)
    results, timings = {}, {}
    wanted = ["CPUExecutionProvider"] + (["CUDAExecutionProvider"] if "CUDAExecutionProvider" in providers else [])
    for provider in wanted:
        t0 = time.perf_counter()
        session = ort.InferenceSession(model_path, providers=[provider])
        load_s = time.perf_counter() - t0
        got = session.get_providers()
        logits, pool = session.run(None, step)
        results[provider] = (logits, pool)
        dec = decode_step(config)
        session.run(None, dec)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            session.run(None, dec)
            times.append(time.perf_counter() - t0)
        timings[provider] = {"session_providers": got, "load_s": round(load_s, 2),
                             "decode_step_ms_batch8_median": round(float(np.median(times)) * 1e3, 3),
                             "note": "host<->device copies of the inputs and the whole pool included (session.run)"}
    note("onnx_engine", {"path": model_path, "backend": config["backend"], "model": config["model"]["architecture"],
                         "providers_run": wanted, "timings": timings,
                         "cuda_ep": "ran" if "CUDAExecutionProvider" in wanted else
                         "absent: only the CPU execution provider ran (this onnxruntime has no CUDA EP)"})
    cpu_logits, cpu_pool = results["CPUExecutionProvider"]
    finite = bool(np.isfinite(cpu_logits).all())
    written = float(np.abs(cpu_pool - step["kv_cache"]).max())
    note("cpu_run", {"logits_shape": list(cpu_logits.shape), "finite": finite, "pool_changed_by": written})
    if "CUDAExecutionProvider" in results:
        logits, pool = results["CUDAExecutionProvider"]
        note("cuda_vs_cpu", {"max_abs_logit_diff": float(np.abs(logits - cpu_logits).max()),
                             "max_abs_logit": float(np.abs(cpu_logits).max()),
                             "max_abs_pool_diff": float(np.abs(pool - cpu_pool).max())})
        check_cuda_in_place(model_path, step, cpu_pool)


@guarded("cuda_in_place")
def check_cuda_in_place(model_path: str, step: dict[str, np.ndarray], cpu_pool: np.ndarray) -> None:
    """The pool input and output bound to one device buffer, as kiln's runtime binds them on the CPU."""
    import onnxruntime as ort

    session = ort.InferenceSession(model_path, providers=["CUDAExecutionProvider"])
    binding = session.io_binding()
    pool = ort.OrtValue.ortvalue_from_numpy(step["kv_cache"].copy(), "cuda", 0)
    for name, value in step.items():
        if name == "kv_cache":
            binding.bind_ortvalue_input(name, pool)
        else:
            binding.bind_cpu_input(name, value)
    binding.bind_ortvalue_output("kv_cache_out", pool)
    binding.bind_output("logits", "cuda")
    session.run_with_iobinding(binding)
    after = pool.numpy()
    note("cuda_in_place", {"max_abs_pool_diff_vs_cpu": float(np.abs(after - cpu_pool).max()),
                           "same_buffer": True})


@guarded("tensorrt")
def check_tensorrt(plan_dir: Path | None, gpu: bool) -> None:
    found = {}
    for name in ("tensorrt", "tensorrt_rtx"):
        try:
            module = __import__(name)
            module.Builder  # noqa: B018
            found[name] = module.__version__
        except Exception as exc:  # noqa: BLE001
            found[name] = f"unavailable ({type(exc).__name__}: {str(exc)[:200]})"
    try:
        from cuda.bindings import runtime as cudart

        err, count = cudart.cudaGetDeviceCount()
        found["cuda-python"] = f"cudaGetDeviceCount: {err}, {count}"
    except Exception as exc:  # noqa: BLE001
        found["cuda-python"] = f"unavailable ({type(exc).__name__})"
    result = {"modules": found}
    usable = [n for n in ("tensorrt", "tensorrt_rtx") if not str(found[n]).startswith("unavailable")]
    if plan_dir is None:
        result["plan"] = "no --plan given"
    elif not gpu:
        result["plan"] = "not deserialized: no GPU visible (a TensorRT runtime without one can crash)"
    elif not usable:
        result["plan"] = "not deserialized: neither tensorrt nor tensorrt_rtx imports"
    else:
        plan = (plan_dir / "rank0.engine").read_bytes()
        for name in usable:
            trt = __import__(name)
            runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            engine = runtime.deserialize_cuda_engine(plan)
            result[f"plan_{name}"] = (f"deserialized: {engine.num_optimization_profiles} profiles, "
                                      f"{engine.num_io_tensors} I/O tensors") if engine else "None"
    note("tensorrt", result)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine_dir", type=Path, help="an onnx engine directory (build-engine --backend onnx)")
    ap.add_argument("--plan", type=Path, default=None, help="a tensorrt engine directory, to try deserializing")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    t0 = time.perf_counter()
    gpu = bool(check_gpu())
    check_onnx(args.engine_dir, args.steps, gpu)
    check_tensorrt(args.plan, gpu)
    note("seconds", round(time.perf_counter() - t0, 1))
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "report.json").write_text(json.dumps(REPORT, indent=2, default=str) + "\n")
        print(f"report written to {out}/report.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
