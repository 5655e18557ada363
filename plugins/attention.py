"""Causal attention of a prompt chunk over its cached context with kiln's kernel (``csrc/attention_kernels.cpp``).

The context path of paged attention calls :func:`causal_attention_paged` first (the sequence's keys and values read
where they sit in the KV pool, no gathered copy: a pool in q's dtype), then :func:`causal_attention` on gathered
(dequantized) ones, and falls back to SDPA when it declines (None): the kernel takes bf16 or fp32 q/k/v (bf16: AMX
tile products where the CPU has AMX-BF16, else vdpbf16ps, P rounded to bf16 either way; fp32: FMA, nothing rounded
below fp32) with head dim 64, 128 or 256, no soft-capping and no active sliding window (the caller checks those
two), on CPUs with AVX-512 BF16. It is the default there: without AMX torch's flash attention runs 73-131 GFLOP/s
against the GEMMs' ~700 (Zen 5), and with AMX (Sapphire Rapids) the tile kernel runs a whole 800-token prompt's
attention 2x faster than SDPA and a chunk after a cached prefix (SDPA's masked path) faster still
(docs/benchmarks.md). ``KILN_ATTENTION=kiln`` or ``=sdpa`` chooses either way on any CPU.
"""

from __future__ import annotations

import os

import torch

from kiln.plugins import native

__all__ = ["causal_attention", "causal_attention_paged", "kernel_route", "set_kernel_route", "set_amx", "describe"]

ROUTES = ("auto", "kiln", "sdpa")
_route: str | None = None


_KERNELS = {torch.bfloat16: "kiln_causal_attention_bf16", torch.float32: "kiln_causal_attention_f32"}


def _takes(dtype: torch.dtype, head_dim: int) -> bool:
    """The element types and head dims the kernel has (csrc/attention_kernels.cpp checks the same)."""
    return dtype in _KERNELS and head_dim % 64 == 0 and head_dim <= 256


def kernel_route() -> str:
    """'kiln' when context attention runs kiln's kernel where it can, else 'sdpa' (``KILN_ATTENTION``, default
    auto: kiln's kernel; it declines on CPUs without AVX-512 BF16, which then run SDPA)."""
    global _route
    if _route is None:
        choice = os.environ.get("KILN_ATTENTION", "auto").strip().lower() or "auto"
        if choice not in ROUTES:
            raise ValueError(f"KILN_ATTENTION={choice!r}: choose one of {', '.join(ROUTES)}")
        _route = "kiln" if choice == "auto" else choice
    return _route


def set_kernel_route(route: str) -> str:
    """Set the route ('kiln', 'sdpa', or 'auto': chosen again from ``KILN_ATTENTION`` and the CPU); returns the
    previous one (tests, benchmarks)."""
    global _route
    if route not in ROUTES:
        raise ValueError(f"attention route {route!r}: choose one of {', '.join(ROUTES)}")
    old = kernel_route()
    _route = None if route == "auto" else route
    return old


def set_amx(on: bool) -> bool:
    """Run the bf16 kernel's products on AMX tiles (where the CPU and OS allow them) or on vdpbf16ps; returns the
    previous setting (tests compare both)."""
    lib = native.library()
    if lib is None:
        return False
    return bool(lib.kiln_causal_attention_set_amx(1 if on else 0))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
    """q [n, Hq, D] (the last n tokens of the context), k/v [ctx, Hkv, D] -> [n, Hq, D]: query i attends keys
    0 .. ctx - n + i. ``out``: a contiguous [n, Hq, D] of q's dtype to write into (default: a new tensor). None where
    the kernel does not take the case (the caller runs SDPA)."""
    return _run(q, k, v, k.shape[0], scale, out)


def causal_attention_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                           ctx: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """As :func:`causal_attention`, with a sequence's ``ctx`` keys and values read in place from one layer of a KV
    pool (``k_pool``/``v_pool`` [blocks, block_size, Hkv, D], key j in block ``block_table[j // block_size]``), so
    they are not gathered into a copy first. None where the kernel does not take the case, or a table entry of
    the first ``ctx`` keys is outside the pool (the caller's gather path then names it)."""
    if k_pool.dim() != 4 or v_pool.shape != k_pool.shape or not (k_pool.is_contiguous() and v_pool.is_contiguous()) \
            or block_table.dim() != 1 or ctx < 1 or block_table.numel() * k_pool.shape[1] < ctx:
        return None
    table = block_table.to(torch.int32).contiguous()
    return _run(q, k_pool, v_pool, ctx, scale, out, table)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, scale: float, out: torch.Tensor | None,
         table: torch.Tensor | None = None) -> torch.Tensor | None:
    n, hq, d = q.shape
    hkv = k.shape[-2]
    if kernel_route() != "kiln" or not _takes(q.dtype, d) or k.dtype != q.dtype or v.dtype != q.dtype or \
            q.device.type != "cpu" or k.shape[-1] != d or hq % hkv or ctx < n or n < 1:
        return None
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous()):
        return None
    lib = native.library()
    if lib is None or not lib.kiln_causal_attention_available():
        return None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q) if out is None else out
    paged = (table.data_ptr(), k.shape[1], k.shape[0]) if table is not None else (None, 0, 0)
    rc = getattr(lib, _KERNELS[q.dtype])(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n, ctx, hq, hkv, d,
                                        float(scale), torch.get_num_threads(), *paged)
    return out if rc == 0 else None


def describe(dtype: str, head_dim: int, softcap: float = 0.0) -> str:
    """Which attention an engine's context sequences run on this machine (kiln inspect --load)."""
    if kernel_route() != "kiln":
        return "torch SDPA (KILN_ATTENTION=sdpa)"
    lib = native.library()
    if lib is None or not lib.kiln_causal_attention_available():
        return "torch SDPA (no native kernels or no AVX-512 BF16 on this CPU)"
    if not _takes(getattr(torch, dtype, None), head_dim) or softcap > 0:
        return f"torch SDPA (kiln's kernel takes bf16 or fp32, head dim 64/128/256, no soft-capping; this engine: " \
               f"{dtype}, head dim {head_dim}{', soft-capped' if softcap > 0 else ''})"
    how = ("AMX tile products" if lib.kiln_causal_attention_amx() else "AVX-512 BF16 dot products") \
        if dtype == "bfloat16" else "AVX-512 fp32 FMA"
    return f"kiln causal attention kernel ({how}; sliding-window layers past their window: SDPA)"
