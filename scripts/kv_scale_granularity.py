"""Which scales for an 8-bit KV cache: one per token and KV head (what kiln stores) or one per block and head?

    .venv/bin/python scripts/kv_scale_granularity.py [--prompts 16] [--length 96]

On the demo's corpus-trained checkpoint (``work/demo-llama-corpus``, see scripts/demo.py) the model runs
``--prompts`` corpus windows of ``--length`` tokens: the first half as one prefill step, then one token per
step (teacher forced), over a float32 pool whose rows are replaced after every step by what an 8-bit pool
would give back (fake quantization, int8 and e4m3):

- per token: each new row is quantized with its own scale (kiln.plugins.kv_quant, the layout kiln uses);
- per block: the block the new row lands in is requantized with one scale per KV head over all its rows so
  far (as a per-block pool must do when a larger value arrives: its earlier rows are rounded again).

Printed per scheme, against the float32 pool on the decode positions: top-1 agreement, max / mean absolute
logit error, and the relative RMS error of the stored keys and values.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from kiln.contract import SeqChunk, kv_cache_shape, pack_inputs
from kiln.model_defs import load_model
from kiln.plugins.kv_quant import QMAX, ceil_to_bfloat16, from_pool, to_pool

from synthetic_checkpoints import CORPUS

ROOT = Path(__file__).resolve().parent.parent
CKPT = ROOT / "work" / "demo-llama-corpus"
BLOCK = 16
POOLS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def per_block(x: torch.Tensor, pool: torch.dtype) -> torch.Tensor:
    """x [..., rows, heads, head_dim] -> dequantized with one scale per head over the rows and head_dim."""
    qmax = QMAX[pool]
    amax = x.abs().amax(dim=(-3, -1), keepdim=True)
    scale = ceil_to_bfloat16((amax / qmax).clamp_min(torch.finfo(torch.float32).tiny))
    n = (x / scale).clamp(-qmax, qmax)
    n = n.round() if pool == torch.int8 else n.to(pool).float()
    return n * scale


def per_token(x: torch.Tensor, pool: torch.dtype) -> torch.Tensor:
    return from_pool(to_pool(x, pool), torch.float32)


def run(module, model, prompts: list[list[int]], scheme) -> tuple[list[torch.Tensor], float]:
    """Decode-position logits of every prompt, and the relative RMS error of the stored rows against the rows as
    the model wrote them; ``scheme(pool, table, lo, hi)`` replaces rows of the pool after each step (per token:
    the new rows; per block: every row of the blocks written). None: float32."""
    need = [-(-len(p) // BLOCK) for p in prompts]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(len(prompts))]
    pool = torch.zeros(kv_cache_shape(model, BLOCK, sum(need), "float32"))
    written = torch.zeros_like(pool)   # each row as the model wrote it

    def step(chunks):
        packed = pack_inputs([SeqChunk(toks, start, tables[i], len(toks)) for i, toks, start in chunks], pool, BLOCK)
        with torch.no_grad():
            logits = module(**packed).float()
        for i, toks, start in chunks:
            for p in range(start, start + len(toks)):
                b, o = tables[i][p // BLOCK], p % BLOCK
                written[:, :, b, o] = pool[:, :, b, o]
            if scheme is not None:
                scheme(pool, tables[i], start, start + len(toks))
        return logits

    split = [len(p) // 2 for p in prompts]
    step([(i, p[: split[i]], 0) for i, p in enumerate(prompts)])
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    for pos in range(min(split), max(len(p) for p in prompts) - 1):
        live = [i for i, p in enumerate(prompts) if split[i] <= pos < len(p) - 1]
        logits = step([(i, [prompts[i][pos]], pos) for i in live])
        for r, i in enumerate(live):
            out[i].append(logits[r])
    rms = ((pool - written).pow(2).sum() / written.pow(2).sum()).sqrt().item()
    return [torch.stack(rows) for rows in out], rms


def token_scheme(pool_dtype):
    def apply(pool, table, lo, hi):
        for p in range(lo, hi):
            b, o = table[p // BLOCK], p % BLOCK
            pool[:, :, b, o] = per_token(pool[:, :, b, o], pool_dtype)
    return apply


def block_scheme(pool_dtype):
    def apply(pool, table, lo, hi):
        for j in range(lo // BLOCK, (hi - 1) // BLOCK + 1):
            n = min(hi - j * BLOCK, BLOCK)
            pool[:, :, table[j], :n] = per_block(pool[:, :, table[j], :n], pool_dtype)
    return apply


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--length", type=int, default=96)
    args = ap.parse_args(argv)
    if not (CKPT / "config.json").exists():
        print(f"{CKPT} is missing: run scripts/demo.py (or scripts/kv_quant_agreement.py) first")
        return 1
    from tokenizers import Tokenizer

    from kiln.model_defs import load_config

    model = load_config(CKPT)
    module = load_model(CKPT, "float32")
    ids = Tokenizer.from_file(str(CKPT / "tokenizer.json")).encode(CORPUS * 2).ids
    rng = random.Random(0)
    prompts = [ids[s:s + args.length] for s in (rng.randrange(0, len(ids) - args.length) for _ in range(args.prompts))]
    ref, _ = run(module, model, prompts, None)
    ref = torch.cat(ref)
    print(f"{args.prompts} corpus windows of {args.length} tokens, {ref.shape[0]} decode positions, block {BLOCK}")
    print(f"{'scheme':<16} {'top-1':>7} {'max err':>8} {'mean err':>9} {'KV rel. RMS err':>16}")
    for name, pool in POOLS.items():
        for label, make in (("per token", token_scheme), ("per block", block_scheme)):
            got, rms = run(module, model, prompts, make(pool))
            got = torch.cat(got)
            err = (got - ref).abs()
            top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
            print(f"{name + ' ' + label:<16} {100 * top1:>6.2f}% {err.max().item():>8.4f} {err.mean().item():>9.5f} "
                  f"{rms:>16.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
