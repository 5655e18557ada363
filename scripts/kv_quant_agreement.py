"""Greedy agreement of 8-bit KV caches with the fp32 one on the demo's corpus-trained checkpoint.

    .venv/bin/python scripts/kv_quant_agreement.py [--prompts 32] [--tokens 48] [--json out.json]

The checkpoint is the one ``scripts/demo.py`` makes (``work/demo-llama-corpus``: a small Llama fitted to the
synthetic corpus, so that its greedy continuations are confident; made here if missing, a few minutes on 2
cores). One engine per KV cache dtype (float32, int8, fp8; the demo's build config, batch 32) generates
``--tokens`` greedy tokens for ``--prompts`` prompts cut from the corpus at random places, all submitted at
once. Agreement of a prompt = the common prefix of its 8-bit output with the fp32 output, over ``--tokens``;
the script prints its mean per KV dtype with the pool's bytes per token (and their ratio to fp32's), the
tokens 1 GiB holds, and the build's own accuracy report (kv_accuracy).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from demo import DEMO_TRAIN_STEPS

from kiln.builder import BuildConfig, build_engine
from kiln.contract import read_build_report, read_engine_config
from kiln.runtime import LLM, SamplingParams

from synthetic_checkpoints import CORPUS, make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
CKPT = ROOT / "work" / "demo-llama-corpus"
KV_DTYPES = ("float32", "int8", "fp8")


def corpus_prompts(ckpt: Path, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` windows of 8 to 24 tokens of the corpus, at random offsets."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(CORPUS).ids
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(8, 24)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start:start + length])
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if not (CKPT / "config.json").exists():
        print(f"creating the demo checkpoint {CKPT} ({DEMO_TRAIN_STEPS} training steps) ...", flush=True)
        make_checkpoint(CKPT, "llama", "small", train_steps=DEMO_TRAIN_STEPS)
    prompts = corpus_prompts(CKPT, args.prompts)
    base = BuildConfig.from_yaml(ROOT / "build_configs" / "tiny-test.yaml").replace(
        tokens_per_block=16, max_batch_size=max(4, args.prompts), max_num_tokens=max(64, args.prompts))
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outputs, results = {}, {}
    for kv in KV_DTYPES:
        out = ROOT / "work" / f"demo-llama-corpus-kv-{kv}"
        t0 = time.perf_counter()
        build_engine(CKPT, out, base.replace(kv_cache_dtype=kv))
        built = time.perf_counter() - t0
        config, report = read_engine_config(out), read_build_report(out) or {}
        with LLM(out, max_kv_cache_tokens=args.prompts * 128) as llm:
            outputs[kv] = [o.token_ids for o in llm.generate(prompts, greedy)]
        results[kv] = {"kv_bytes_per_token": config.kv_bytes_per_token,
                       "kv_tokens_per_gib": config.memory.kv_tokens_per_gib, "build_s": round(built, 1),
                       "build_report_accuracy": report.get("kv_cache_accuracy")}
    ref = outputs["float32"]
    print(f"{len(prompts)} corpus prompts x {args.tokens} greedy tokens, {CKPT.name}")
    print(f"{'kv dtype':<9} {'agreement':>9} {'exact':>7} {'B/token':>8} {'x fp32':>7} {'tokens/GiB':>11}  "
          "build report")
    for kv in KV_DTYPES:
        r = results[kv]
        prefixes = [common_prefix(a, b) / args.tokens for a, b in zip(outputs[kv], ref)]
        r["mean_common_prefix"] = round(sum(prefixes) / len(prefixes), 4)
        r["identical_outputs"] = sum(p == 1.0 for p in prefixes)
        r["bytes_vs_fp32"] = round(r["kv_bytes_per_token"] / results["float32"]["kv_bytes_per_token"], 4)
        acc = r["build_report_accuracy"]
        acc_text = (f"top-1 {100 * acc['top1_agreement']:.1f}%, logit err max {acc['max_abs_logit_error']:.3g}"
                    if acc else "-")
        print(f"{kv:<9} {r['mean_common_prefix']:>9.3f} {r['identical_outputs']:>4}/{len(prompts):<2} "
              f"{r['kv_bytes_per_token']:>8} {r['bytes_vs_fp32']:>7.3f} {r['kv_tokens_per_gib']:>11,}  {acc_text}")
    if args.json:
        args.json.write_text(json.dumps({"prompts": len(prompts), "tokens": args.tokens, "results": results},
                                        indent=2) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
