"""Main job on a small bundled default: make a checkpoint, build an engine, load it, run a packed step.

1. a small random Llama checkpoint (``work/demo-llama-small``) is created if missing;
2. ``build_engine`` turns it into an engine directory (``work/demo-llama-small-engine``), printing
   each stage and the summary that ``build-engine`` prints;
3. ``kiln.runtime.Engine`` loads the directory (no model code) and runs one packed forward over
   three prompts, then a few decode steps with the KV cache.

Later stages (runtime) extend this into generation.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from kiln.builder import BuildConfig, build_engine
from kiln.builder.cli import print_table, summary_rows
from kiln.model_defs.synthetic import make_checkpoint
from kiln.runtime import Engine

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ckpt = ROOT / "work" / "demo-llama-small"
    engine_dir = ROOT / "work" / "demo-llama-small-engine"
    if not (ckpt / "config.json").exists():
        print(f"creating a small random Llama checkpoint in {ckpt} ...")
        make_checkpoint(ckpt, "llama", "small")

    build = BuildConfig.from_yaml(ROOT / "build_configs" / "tiny-test.yaml").replace(tokens_per_block=16)
    print(f"building {ckpt.name} -> {engine_dir.name} ({build.backend}, {build.dtype})")
    build_engine(ckpt, engine_dir, build,
                 progress=lambda stage, msg: print(f"  {stage:<12} {msg}", flush=True))
    print_table(summary_rows(json.loads((engine_dir / "config.json").read_text()),
                             json.loads((engine_dir / "build_report.json").read_text())))

    engine = Engine.from_dir(engine_dir)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
    prompts = ["The kiln fires the clay", "Tokens flow through", "Memory is the wall:"]
    ids = [tok.encode(p).ids for p in prompts]
    block = engine.build["tokens_per_block"]
    max_len = max(len(s) for s in ids) + 8
    per_seq = (max_len + block - 1) // block
    kv = engine.allocate_kv_cache(per_seq * len(ids))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(ids))]

    def step(new: list[list[int]], starts: list[int]) -> torch.Tensor:
        tokens, pos, slots, logits_idx = [], [], [], []
        for s, (toks, start) in enumerate(zip(new, starts)):
            for j, t in enumerate(toks):
                p = start + j
                tokens.append(t)
                pos.append(p)
                slots.append(tables[s][p // block] * block + p % block)
            logits_idx.append(len(tokens) - 1)
        return engine.run({
            "input_ids": torch.tensor(tokens), "position_ids": torch.tensor(pos),
            "seq_lens": torch.tensor([len(t) for t in new], dtype=torch.int32),
            "context_lens": torch.tensor([s + len(t) for s, t in zip(starts, new)], dtype=torch.int32),
            "block_tables": torch.tensor(tables, dtype=torch.int32), "slot_mapping": torch.tensor(slots),
            "logits_indices": torch.tensor(logits_idx), "kv_cache": kv,
        })

    t0 = time.perf_counter()
    logits = step(ids, [0] * len(ids))
    prefill_ms = (time.perf_counter() - t0) * 1e3
    outs = [[int(r.argmax())] for r in logits]
    lens = [len(s) for s in ids]
    t0 = time.perf_counter()
    for _ in range(7):  # greedy decode steps, all three sequences batched
        logits = step([[o[-1]] for o in outs], lens)
        lens = [n + 1 for n in lens]
        for o, r in zip(outs, logits):
            o.append(int(r.argmax()))
    decode_ms = (time.perf_counter() - t0) * 1e3 / 7
    for prompt, o in zip(prompts, outs):
        print(f"{prompt!r:28} -> {tok.decode(o)!r}")
    print(f"prefill of {sum(len(s) for s in ids)} tokens in {len(ids)} sequences: {prefill_ms:.1f} ms; "
          f"decode step (batch {len(ids)}): {decode_ms:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
