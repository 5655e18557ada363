"""The weights a step streams, read from the weights file into memory backed by huge pages.

Why: ``rank{r}.weights`` is mapped (:func:`kiln.contract.load_weights`) in the page cache's 4 KiB pages, and a
decode step streams every weight once; each 4 KiB page is then a TLB miss and a new start for the hardware
prefetchers, which do not cross pages. One anonymous region with ``MADV_HUGEPAGE`` (2 MiB pages where the kernel's
transparent huge pages allow them) streams faster (docs/benchmarks.md, session 20). Each streamed tensor's bytes
are read from the file (``os.preadv``, at the offset where the mapping holds it) straight into the region, so the
mapping's pages of those tensors are never touched: the process holds each weight once, and no more than that
while it loads. The tables that only row lookups read (an untied embedding table; the builder's memory plan names
them) stay mapped: a step gathers a few of their rows, and most are never read.

``KILN_HUGE_PAGE_WEIGHTS=0`` keeps every weight in the mapped file (processes serving the same engine then share
its page cache).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

import torch

from kiln.runtime.zero_pages import anonymous_region

ENV = "KILN_HUGE_PAGE_WEIGHTS"
HUGE_PAGE = 2 << 20
ALIGN = 4096


def enabled() -> bool:
    """On unless ``KILN_HUGE_PAGE_WEIGHTS=0``, and only where the kernel has transparent huge pages for madvise."""
    if os.environ.get(ENV, "1").strip() == "0":
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def streamed(name: str, gathered: Collection[str] | None = None) -> bool:
    """Does a decode step read this weight whole? All but the tables that only row lookups read (``gathered``: the
    engine's memory plan; engines built before it recorded them: by name, the embedding table)."""
    return name not in gathered if gathered is not None else not name.startswith("embed_tokens")


def _file_offset(maps: list[tuple[int, int, int]], ptr: int) -> int | None:
    """The file offset of address ``ptr`` in one of ``maps`` ((start, end, file offset) of the file's mappings)."""
    for start, end, offset in maps:
        if start <= ptr < end:
            return offset + ptr - start
    return None


def _mappings(path: Path) -> list[tuple[int, int, int]]:
    """This process's mappings of ``path``: (start, end, file offset)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip("\n") == str(path):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, int(parts[2], 16)))
    return out


def _read_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"the weights file ended at byte {offset + done} while reading it into huge pages")
        done += n


def to_huge_pages(weights: dict[str, torch.Tensor], path: str | Path,
                  gathered: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """``weights`` (the tensors :func:`kiln.contract.load_weights` mapped from ``path``) with every :func:`streamed`
    tensor read into one huge-page region (the others as they are). The region lives as long as any of its tensors
    (:func:`kiln.runtime.zero_pages.anonymous_region`)."""
    path = Path(path).resolve()
    maps = _mappings(path)
    moved = {}
    for name, t in weights.items():
        offset = _file_offset(maps, t.data_ptr()) if t.numel() > 0 else None
        if streamed(name, gathered) and t.is_contiguous() and offset is not None:
            moved[name] = offset
    if not moved:
        return dict(weights)
    nbytes = {k: weights[k].numel() * weights[k].element_size() for k in moved}
    sizes = {k: (n + ALIGN - 1) // ALIGN * ALIGN for k, n in nbytes.items()}
    base, region = anonymous_region(sum(sizes.values()) + HUGE_PAGE, huge_pages=True)
    view = memoryview(region)
    at = (-base.data_ptr()) % HUGE_PAGE
    out = dict(weights)
    with open(path, "rb") as f:
        for name, offset in moved.items():
            _read_into(f.fileno(), view[at:at + nbytes[name]], offset)
            src = weights[name]
            out[name] = base[at:at + nbytes[name]].view(src.dtype).view(src.shape)
            at += sizes[name]
    view.release()
    return out


def place(weights: dict[str, torch.Tensor], path: str | Path,
          gathered: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """:func:`to_huge_pages` where :func:`enabled`, else ``weights`` as mapped."""
    return to_huge_pages(weights, path, gathered) if enabled() else weights
