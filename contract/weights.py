"""The engine's weights file: every tensor the compiled graph reads, stored once, mapped at load.

``rank{r}.weights`` holds, by the name the graph knows it under (the ExportedProgram's state-dict and
constant names, which are also the AOTInductor package's constant names), every weight of rank r. The
graph file (``rank{r}.engine``) holds none: it is loaded next to this file and given its tensors.

The format is ``torch.save`` of a flat ``{name: tensor}`` dict (a zip whose tensor records are 64-byte
aligned), read with ``torch.load(mmap=True)``: the tensors are views of the mapped file, so loading
copies nothing, pages come in as the first steps read them, and a process holds each weight once (as
page-cache pages it shares with every other process serving the same engine). Tied tensors (an lm_head
that is the embedding table) are stored once and come back as one tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from kiln.contract.errors import EngineLoadError

__all__ = ["weights_file", "save_weights", "load_weights", "weights_nbytes"]


def weights_file(rank: int) -> str:
    """The weights file of tensor-parallel rank ``rank`` (next to ``rank{rank}.engine``)."""
    return f"rank{rank}.weights"


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it spans its whole storage, else a compact copy (torch.save writes whole storages:
    a view into a bigger tensor would store the bigger tensor)."""
    t = t.detach()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def save_weights(tensors: Mapping[str, torch.Tensor], path: str | Path) -> int:
    """Write ``tensors`` (name -> tensor, tied names may share one tensor) to ``path``; returns the bytes of
    tensor data written (each shared tensor once)."""
    out: dict[str, torch.Tensor] = {}
    compact: dict[int, torch.Tensor] = {}  # id(original) -> stored tensor, so ties stay ties
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.is_meta:
            raise ValueError(f"weight {name!r} is not a tensor with data ({type(t).__name__})")
        if id(t) not in compact:
            compact[id(t)] = _own_storage(t)
        out[name] = compact[id(t)]
    with open(path, "wb") as f:
        torch.save(out, f)
    return weights_nbytes(out)


def weights_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data, each storage once."""
    seen: dict[int, int] = {}
    for t in tensors.values():
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, as views of the mapped file (nothing is read until used).

    EngineLoadError when the file is missing or not a weights file."""
    path = Path(path)
    if not path.is_file():
        raise EngineLoadError(f"{path}: missing; the engine directory is incomplete, rebuild it")
    try:
        tensors = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise EngineLoadError(f"{path}: not a readable weights file ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); it is corrupt or truncated, "
                              "rebuild the engine") from None
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in tensors.items()):
        raise EngineLoadError(f"{path}: not a kiln weights file (expected a dict of named tensors); "
                              "rebuild the engine")
    return tensors
