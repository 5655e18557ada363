"""The weights a step streams, moved from the mapped weights file into memory backed by huge pages.

Why: ``rank{r}.weights`` is mapped (:func:`kiln.contract.load_weights`) in the page cache's 4 KiB pages, and a
decode step streams every weight once; each 4 KiB page is then a TLB miss and a new start for the hardware
prefetchers, which do not cross pages. One anonymous region with ``MADV_HUGEPAGE`` (2 MiB pages where the kernel's
transparent huge pages allow them) streams faster (docs/benchmarks.md, session 20). The copy is made in chunks,
and each chunk's pages of the file mapping are dropped from the process as soon as they are copied
(``MADV_DONTNEED``: the page cache keeps them; the mapping is only read), so the process still holds each weight
once, and its peak grows by one chunk at most. The embedding table stays mapped: a step gathers a few of its
rows, and most of them are never read.

``KILN_HUGE_PAGE_WEIGHTS=0`` keeps every weight in the mapped file (processes serving the same engine then share
its page cache).
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

ENV = "KILN_HUGE_PAGE_WEIGHTS"
HUGE_PAGE = 2 << 20
CHUNK = 2 << 20           # bytes copied before their source pages are released
ALIGN = 4096
MADV_DONTNEED = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def enabled() -> bool:
    """On unless ``KILN_HUGE_PAGE_WEIGHTS=0``, and only where the kernel has transparent huge pages for madvise."""
    if os.environ.get(ENV, "1").strip() == "0":
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def streamed(name: str) -> bool:
    """Does a decode step read this weight whole? All but the embedding table (rows gathered by token)."""
    return not name.startswith("embed_tokens")


def _release(ptr: int, nbytes: int) -> None:
    """Drop the whole pages of [ptr, ptr + nbytes) from this process (a read-only file mapping: the page cache
    keeps them, and a later read maps them again)."""
    start = (ptr + ALIGN - 1) // ALIGN * ALIGN
    end = (ptr + nbytes) // ALIGN * ALIGN
    if end > start:
        _libc.madvise(start, end - start, MADV_DONTNEED)


def to_huge_pages(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with every streamed tensor copied into one huge-page region (the others as they are). The
    region lives as long as any of its tensors (torch.frombuffer holds it)."""
    moved = {k: v for k, v in weights.items() if streamed(k) and v.is_contiguous() and v.numel() > 0}
    if not moved:
        return dict(weights)
    sizes = {k: (v.numel() * v.element_size() + ALIGN - 1) // ALIGN * ALIGN for k, v in moved.items()}
    region = mmap.mmap(-1, sum(sizes.values()) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(region, dtype=torch.uint8)
    offset = (-base.data_ptr()) % HUGE_PAGE
    out = dict(weights)
    for name, src in moved.items():
        nbytes = src.numel() * src.element_size()
        dst = base[offset:offset + nbytes]
        for lo in range(0, nbytes, CHUNK):   # single-threaded copies: no OpenMP team on the loading thread
            n = min(CHUNK, nbytes - lo)
            ctypes.memmove(dst.data_ptr() + lo, src.data_ptr() + lo, n)
            _release(src.data_ptr() + lo, n)
        out[name] = dst.view(src.dtype).view(src.shape)
        offset += sizes[name]
    return out
