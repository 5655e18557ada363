"""Main job on a small bundled default: make a checkpoint, load it, run a batched packed forward.

Later stages (builder, runtime) extend this into build-engine + generate.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from kiln.model_defs import load_model
from kiln.model_defs.synthetic import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ckpt = ROOT / "work" / "demo-llama-small"
    if not (ckpt / "config.json").exists():
        print(f"creating a small random Llama checkpoint in {ckpt} ...")
        make_checkpoint(ckpt, "llama", "small")
    model = load_model(ckpt)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    prompts = ["The kiln fires the clay", "Tokens flow through", "Memory is the wall:"]
    ids = [tok.encode(p).ids for p in prompts]
    block = 16
    total_blocks = sum((len(i) + block - 1) // block for i in ids)
    cfg = model.config
    kv = torch.zeros(cfg.num_layers, 2, total_blocks, block, cfg.num_kv_heads, cfg.head_dim)
    tables, slots, nxt = [], [], 0
    for seq in ids:
        nb = (len(seq) + block - 1) // block
        tables.append(list(range(nxt, nxt + nb)))
        slots += [nxt * block + p for p in range(len(seq))]
        nxt += nb
    width = max(len(t) for t in tables)
    lens = [len(s) for s in ids]
    t0 = time.perf_counter()
    logits = model(
        torch.tensor([t for s in ids for t in s]),
        torch.tensor([p for s in ids for p in range(len(s))]),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(slots),
        torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))]),
        kv,
    )
    ms = (time.perf_counter() - t0) * 1e3
    for prompt, row in zip(prompts, logits):
        token = int(row.argmax())
        print(f"{prompt!r:32} -> next token {token} {tok.decode([token])!r}")
    print(f"one packed forward of {sum(lens)} tokens in {len(ids)} sequences: {ms:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
