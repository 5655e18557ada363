"""Tensor-parallel collectives as plugin ops: ``kiln::all_reduce`` and ``kiln::all_gather``.

A sharded engine's graph calls them where partial results meet (after each row-parallel GEMM, and on the
vocab-parallel logits). They are ops like the other plugins: a fake kernel for tracing (no process group
is needed to build an engine), and a CPU implementation over the ``torch.distributed`` process group the
runtime sets with :func:`set_group` before each step (a gloo group on CPU; an NCCL group would serve a
GPU backend), called through the group object itself, so no global ``torch.distributed`` state is
needed. The ExportedProgram of the ``cpu`` backend calls them directly; an AOTInductor package calls
them back through the dispatcher, as it does every Python-registered kiln op.

Why not torch's functional collectives (``_c10d_functional.all_reduce`` + ``wait_tensor``): they survive
torch.export and AOTInductor on CPU too, but they bake the process group's *name* into the graph at
trace time (so a build needs a process group of that name, and the runtime must register its group
under it), where these ops find their group at run time.

Each call's time is added to :func:`stats` (the benchmark reads it: time per step in collectives).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

__all__ = ["all_gather", "all_reduce", "reset_stats", "set_group", "stats"]

_local = threading.local()      # .group: per thread (several engines may run in one process)
_stats: dict[str, list[float]] = {}   # op -> [calls, seconds, bytes sent by this rank's tensor]


def set_group(group: dist.ProcessGroup | None) -> None:
    """The process group of the tensor-parallel ranks whose step the calling thread runs next (None: none; the
    ops then refuse to run)."""
    _local.group = group


def _require_group() -> dist.ProcessGroup:
    group = getattr(_local, "group", None)
    if group is None:
        raise RuntimeError("a tensor-parallel engine's collective ran outside kiln's tensor-parallel runtime (no "
                           "process group is set); load tensor-parallel engines with kiln.runtime (LLM, "
                           "Engine.from_dir)")
    return group


def _record(op: str, t0: float, x: torch.Tensor) -> None:
    s = _stats.setdefault(op, [0, 0.0, 0])
    s[0] += 1
    s[1] += time.perf_counter() - t0
    s[2] += x.numel() * x.element_size()


def stats() -> dict[str, dict[str, float]]:
    """{op: {"calls", "seconds", "bytes"}} since the last :func:`reset_stats` (this process only)."""
    return {op: {"calls": c, "seconds": s, "bytes": b} for op, (c, s, b) in _stats.items()}


def reset_stats() -> None:
    _stats.clear()


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)   # functional: the input is not written
    if out.numel():
        t0 = time.perf_counter()
        _require_group().allreduce([out]).wait()
        _record("all_reduce", t0, out)
    return out


def _gathered(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] * tp_size)


def _all_gather(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if x.numel() == 0:      # a step with no logits rows: every rank sees the same shape, nothing to send
        return _gathered(x, tp_size)
    group = _require_group()
    size = group.size()
    if size != tp_size:
        raise RuntimeError(f"this engine was built for {tp_size} tensor-parallel ranks, the process group has {size}")
    t0 = time.perf_counter()
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(size)]
    group.allgather([parts], [x.contiguous()]).wait()
    _record("all_gather", t0, x)
    return torch.cat(parts, dim=-1)


_lib = torch.library.Library("kiln", "FRAGMENT")
_lib.define("all_reduce(Tensor x) -> Tensor")
_lib.define("all_gather(Tensor x, int tp_size) -> Tensor")
_lib.impl("all_reduce", _all_reduce, "CompositeExplicitAutograd")
_lib.impl("all_gather", _all_gather, "CompositeExplicitAutograd")
torch.library.register_fake("kiln::all_reduce", lambda x: torch.empty_like(x, memory_format=torch.contiguous_format),
                            lib=_lib)
torch.library.register_fake("kiln::all_gather", _gathered, lib=_lib)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """``torch.ops.kiln.all_reduce``: the sum of ``x`` over the tensor-parallel ranks."""
    return torch.ops.kiln.all_reduce(x)


def all_gather(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """``torch.ops.kiln.all_gather``: the ranks' ``x`` concatenated along the last dim, in rank order."""
    return torch.ops.kiln.all_gather(x, tp_size)
