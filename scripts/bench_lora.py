"""Multi-LoRA benchmark (not a test): the decode step of an engine serving adapters vs the base engine.

    .venv/bin/python scripts/bench_lora.py --prepare        # build the engines and adapters (untimed)
    /work/tools/cpu-exclusive .venv/bin/python scripts/bench_lora.py [--steps 30] [--rounds 3]

A random Llama (synthetic_checkpoints' 246m preset, created once under work/bench) is built twice with the same
bounds: without adapters (the base) and with ``--lora-target-modules`` all 7 (q/k/v/o, gate/up/down) and
``--max-lora-rank 16``. Four random rank-16 adapters (PEFT's file layout, written here) are loaded into the
runtime's adapter pool. Each round runs, on each engine in turn, ``--steps`` decode steps (``engine.run`` on a
paged batch of sequences holding 128 tokens of context: no scheduler or sampler), so all see the same machine
within a round:

- batch 16: the base engine; the LoRA engine with 4 adapters (4 sequences each); the LoRA engine with no
  adapter on any sequence (what the op costs when nobody uses it);
- batch 1: the base engine; the LoRA engine with one adapter, and with none.

Targets (issue 25): batch 16 with 4 adapters <= 1.3x the base step; one adapter at batch 1 <= 1.15x.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch

from bench_common import BENCH, decode_step_times, ensure_checkpoint, ensure_engine, log

CONTEXT = 128
RANK = 16
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
NUM_ADAPTERS = 4


def build_config(dtype: str, backend: str) -> dict:
    return dict(dtype=dtype, backend=backend, max_batch_size=16, max_input_len=256, max_seq_len=512,
                max_num_tokens=2048)


def write_adapter(out: Path, layout, seed: int) -> Path:
    """A random rank-RANK adapter of every module of ``layout`` as PEFT saves one (adapter_config.json +
    adapter_model.safetensors); A and B ~ N(0, 0.02) so that the deltas stay small next to the base."""
    from safetensors.torch import save_file

    if (out / "adapter_model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layout.num_layers):
        for m in layout.modules:
            path = "base_model.model." + m.hf_path.format(layer=layer)
            tensors[f"{path}.lora_A.weight"] = torch.randn(RANK, m.in_features, generator=g) * 0.02
            tensors[f"{path}.lora_B.weight"] = torch.randn(m.out_features, RANK, generator=g) * 0.02
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": TARGETS.split(","),
        "bias": "none", "use_rslora": False}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="246m", help="synthetic_checkpoints preset of the Llama (default 246m)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="cpu-compiled")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prepare", action="store_true", help="build the engines and write the adapters, then exit")
    args = ap.parse_args()
    from kiln.runtime import Engine
    from kiln.runtime.adapters import AdapterPool, AdapterRegistry

    ckpt = ensure_checkpoint(args.size)
    build = build_config(args.dtype, args.backend)
    tag = f"llama-{args.size}-{args.dtype}-{args.backend}"
    base_dir = ensure_engine(f"{tag}-base", build, ckpt)
    lora_dir = ensure_engine(f"{tag}-lora{RANK}", {**build, "lora_target_modules": TARGETS.split(","),
                                                   "max_lora_rank": RANK}, ckpt)
    lora = Engine.from_dir(lora_dir)
    layout = lora.config.lora
    paths = [write_adapter(BENCH / f"lora-{args.size}-r{RANK}-{i}", layout, i) for i in range(NUM_ADAPTERS)]
    if args.prepare:
        return
    base = Engine.from_dir(base_dir)
    registry = AdapterRegistry(layout, lora.config.torch_dtype)
    pool = AdapterPool(lora.allocate_lora_pool(NUM_ADAPTERS))
    slots = [pool.acquire(registry.load(f"a{i}", p)) for i, p in enumerate(paths)]
    cases = {
        "b16 base": (base, 16, None),
        "b16 lora 4 adapters": (lora, 16, [slots[s % NUM_ADAPTERS] for s in range(16)]),
        "b16 lora no adapter": (lora, 16, [-1] * 16),
        "b1 base": (base, 1, None),
        "b1 lora 1 adapter": (lora, 1, [slots[0]]),
        "b1 lora no adapter": (lora, 1, [-1]),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.rounds):
        for name, (engine, batch, seq_slots) in cases.items():
            weights = pool.weights if seq_slots is not None else None
            times[name] += decode_step_times(engine, batch, args.steps, CONTEXT, seq_slots, weights)
        log(f"round {r + 1}/{args.rounds} done")
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    model = lora.config.model
    print(f"\n{datetime.date.today()} {model.architecture} {args.size}: {model.num_layers} layers, hidden "
          f"{model.hidden_size}, {args.dtype}, {args.backend} backend, {torch.get_num_threads()} threads; LoRA rank "
          f"{RANK} on {TARGETS}; decode, {CONTEXT} tokens of context; median of {args.rounds} x {args.steps} steps")
    print(f"{'case':<22} {'ms/step':>9} {'vs base':>8}")
    for name, ms in med.items():
        ref = med["b16 base"] if name.startswith("b16") else med["b1 base"]
        print(f"{name:<22} {ms:>9.2f} {ms / ref:>7.3f}x")
    print(f"target: b16 with 4 adapters <= 1.30x: {med['b16 lora 4 adapters'] / med['b16 base']:.3f}x; "
          f"b1 with 1 adapter <= 1.15x: {med['b1 lora 1 adapter'] / med['b1 base']:.3f}x")
    print(f"adapter pool: {NUM_ADAPTERS} slots x {layout.slot_bytes(lora.config.torch_dtype) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
