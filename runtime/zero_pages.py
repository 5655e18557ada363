"""Tensors over fresh anonymous memory: the kernel's zero pages, made resident only as they are written.

Why: a KV pool is sized from the memory the machine has (gigabytes where it has them), and a step writes only the
blocks its sequences hold. ``torch.zeros`` writes every byte at allocation: the whole pool resident from the start
(the process's idle and peak RSS), seconds of memset at startup for a large one, and a two-thread OpenMP loop on
whichever thread allocates (a second OpenMP team makes every parallel region of the step loop sleep and wake:
:mod:`kiln.plugins.openmp_teams`). An anonymous mapping reads as zeros from the start and costs nothing until a
page is written; its size is rounded up to whole pages.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["anonymous_region", "zero_pages"]


def anonymous_region(nbytes: int, huge_pages: bool = False) -> tuple[torch.Tensor, mmap.mmap]:
    """``nbytes`` (> 0) of a fresh private anonymous mapping as a uint8 tensor (page-aligned, reading as zeros; the
    tensor keeps the mapping alive and it is unmapped when the last tensor over it is freed), and the mapping itself
    (for reads into it). ``huge_pages``: advise the kernel to back it with transparent huge pages."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages:
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8), region


def zero_pages(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of ``shape`` and ``dtype`` that reads as zeros, over its own anonymous mapping
    (:func:`anonymous_region`)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return anonymous_region(nbytes)[0].view(dtype).view(shape)
