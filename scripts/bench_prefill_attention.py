"""Context (prefill) attention of one layer: kiln's kernel against torch's SDPA (not a test).

    .venv/bin/python scripts/bench_prefill_attention.py [--heads 16] [--kv-heads 4] [--head-dim 64] [--rounds 5]
                                                        [--cases 256,800,1600,1600:128] [--dtype bfloat16]

A case ``P`` is a whole prompt of P tokens; ``C:N`` a chunk of N new tokens after C - N cached ones (what a chunked
prefill step computes). Each round times every route once per case, alternating (best of ``--rounds``, ms a call):

  kiln-amx   kiln's kernel, bf16 products on AMX tiles (CPUs with AMX-BF16; skipped elsewhere)
  kiln-avx   the same kernel on AVX-512 BF16 dot products (fp32: FMA)
  sdpa       what paged attention runs without the kernel: SDPA's causal kernel for a whole prompt, its masked
             call for a chunk (plugins/paged_attention.py)

GFLOP/s counts the causal half: 4 x heads x head_dim per query and visible key.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kiln.plugins import attention, native
from kiln.plugins.openmp_teams import on_own_thread

from bench_common import best_per_call_s


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    n, ctx = q.shape[0], k.shape[0]
    qq, kk, vv = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if n == ctx:
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
    mask = torch.arange(ctx)[None] <= torch.arange(ctx - n, ctx)[:, None]
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask[None, None], scale=scale, enable_gqa=True)


def best_ms(fn, rounds: int, calls: int = 4) -> float:
    return best_per_call_s(fn, calls, rounds) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default="256,800,1600,1600:128")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()
    lib = native.library()
    if lib is None or not lib.kiln_causal_attention_available():
        raise SystemExit("kiln's attention kernel needs AVX-512 BF16; this CPU runs SDPA only")
    dtype = getattr(torch, args.dtype)
    routes = ["kiln-amx", "kiln-avx", "sdpa"]
    attention.set_amx(True)
    if dtype != torch.bfloat16 or not lib.kiln_causal_attention_amx():   # fp32 has no AMX route; nor a CPU without it
        routes.remove("kiln-amx")
    attention.set_kernel_route("kiln")
    scale = args.head_dim ** -0.5
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"cpu: {cpu}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{args.heads} heads / {args.kv_heads} kv heads of {args.head_dim}")
    print(f"{'case':>10s} " + " ".join(f"{r:>20s}" for r in routes))

    def run() -> None:
        for case in args.cases.split(","):
            ctx, _, new = case.partition(":")
            ctx, n = int(ctx), int(new or ctx)
            g = torch.Generator().manual_seed(ctx)
            q = torch.randn(n, args.heads, args.head_dim, generator=g).to(dtype)
            k = torch.randn(ctx, args.kv_heads, args.head_dim, generator=g).to(dtype)
            v = torch.randn(ctx, args.kv_heads, args.head_dim, generator=g).to(dtype)
            flops = 4 * args.heads * args.head_dim * sum(ctx - n + i + 1 for i in range(n))
            cells = []
            for route in routes:
                if route == "sdpa":
                    ms = best_ms(lambda: sdpa(q, k, v, scale), args.rounds)
                else:
                    attention.set_amx(route == "kiln-amx")
                    ms = best_ms(lambda: attention.causal_attention(q, k, v, scale), args.rounds)
                cells.append(f"{ms:8.2f} ms {flops / ms / 1e6:5.0f} GF/s")
            print(f"{case:>10s} " + " ".join(f"{c:>20s}" for c in cells), flush=True)
        attention.set_amx(True)

    on_own_thread(run, name="bench-prefill-attention")   # no OpenMP team on the main thread (openmp_teams)


if __name__ == "__main__":
    main()
