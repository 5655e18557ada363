"""The tensor-parallel mapping: how a model's weights and KV heads are split over ``tp_size`` ranks.

Written once here because the builder shards by it, the runtime sizes each rank's KV pool by it, and
``config.json`` records it (``EngineConfig.tensor_parallel``). The layout is Megatron's, as in
TensorRT-LLM and vLLM:

* attention: Q/K/V column-parallel by heads (rank r holds query heads ``[r*H/N, (r+1)*H/N)`` and the KV
  heads they read), O row-parallel followed by an all-reduce (its bias is added once, after the sum);
  when ``num_kv_heads < tp_size`` each KV head is replicated on ``tp_size / num_kv_heads`` ranks;
* MLP: gate/up (fc_in) column-parallel, down (fc_out) row-parallel + all-reduce; an MoE layer's experts the
  same way, each expert's intermediate dim split (the router replicated: every rank routes alike);
* embedding replicated: a lookup costs no compute, and splitting it would add one all-reduce of
  ``[tokens, hidden]`` per step to save ``vocab x hidden`` bytes per rank;
* LM head vocab-parallel: each rank multiplies ``vocab / N`` rows (the largest GEMM of a decode step
  is split, not repeated) and the logits rows are all-gathered (``num_logits x vocab`` floats per
  step). The vocabulary is padded with zero rows to a multiple of ``tp_size``; the padding is cut off
  after the gather.

Every rank file carries a small stamp (rank, tp_size, the build's id) so that a rank file from another
rank or another build is refused by name at load time.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kiln.contract.errors import BuildConfigError, EngineLoadError
from kiln.contract.model import ModelConfig

EMBEDDING_LAYOUT = "replicated"
LM_HEAD_LAYOUT = "vocab_parallel"
STAMP_NAME = "kiln/rank.json"   # inside the rank file's zip archive, under its top folder


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mapping_problems(model: ModelConfig, tp_size: int) -> list[str]:
    """Why ``model`` cannot be split over ``tp_size`` ranks (empty when it can), each naming the numbers."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        return [f"tp_size={tp_size!r} must be a positive integer"]
    if tp_size == 1:
        return []
    out = []
    h, kv, inter = model.num_heads, model.num_kv_heads, model.intermediate_size
    if tp_size > h:
        out.append(f"tp_size={tp_size} is larger than the model's num_heads={h}: each rank needs at least one "
                   f"attention head; use a tp_size that divides {h} ({_divisors(h)})")
    elif h % tp_size:
        out.append(f"tp_size={tp_size} does not divide num_heads={h}: each rank takes whole attention heads; use a "
                   f"tp_size that divides {h} ({_divisors(h)})")
    if kv % tp_size and tp_size % kv:
        out.append(f"tp_size={tp_size} and num_kv_heads={kv}: KV heads are either split (num_kv_heads a multiple of "
                   f"tp_size) or replicated (tp_size a multiple of num_kv_heads), and neither holds")
    if inter % tp_size:
        out.append(f"tp_size={tp_size} does not divide intermediate_size={inter}: each rank takes an equal slice of "
                   f"the MLP; use a tp_size that divides {inter}")
    moe = model.moe_intermediate_size
    if model.num_experts and moe % tp_size:
        out.append(f"tp_size={tp_size} does not divide moe_intermediate_size={moe}: each rank takes an equal slice of "
                   f"every expert; use a tp_size that divides {moe}")
    return out


@dataclass(frozen=True)
class TensorParallelMapping:
    """What each rank holds (``config.json``'s ``tensor_parallel``)."""

    tp_size: int
    num_heads_per_rank: int
    num_kv_heads_per_rank: int
    kv_head_replicas: int              # ranks holding each KV head: 1 = split; > 1 = replicated
    intermediate_size_per_rank: int
    vocab_size_per_rank: int           # LM head rows per rank (the vocabulary padded to a multiple of tp_size)
    embedding: str                     # "replicated"
    lm_head: str                       # "vocab_parallel"
    build_id: str                      # stamped into every rank file of the build

    @classmethod
    def plan(cls, model: ModelConfig, tp_size: int, build_id: str | None = None) -> TensorParallelMapping:
        """The mapping of ``model`` over ``tp_size`` ranks; BuildConfigError naming the numbers when it cannot be
        split that way."""
        problems = mapping_problems(model, tp_size)
        if problems:
            raise BuildConfigError("cannot split the model over tensor-parallel ranks:\n  - " + "\n  - ".join(problems))
        kv = model.num_kv_heads
        return cls(
            tp_size=tp_size,
            num_heads_per_rank=model.num_heads // tp_size,
            num_kv_heads_per_rank=max(kv // tp_size, 1),
            kv_head_replicas=max(tp_size // kv, 1),
            intermediate_size_per_rank=model.intermediate_size // tp_size,
            vocab_size_per_rank=-(-model.vocab_size // tp_size),
            embedding=EMBEDDING_LAYOUT,
            lm_head=LM_HEAD_LAYOUT,
            build_id=build_id if build_id is not None else uuid.uuid4().hex,
        )

    def problems(self, model: ModelConfig) -> list[str]:
        """Disagreements with the mapping ``model`` gets (a hand-edited or foreign config.json)."""
        want = mapping_problems(model, self.tp_size)
        if want:
            return [f"tensor_parallel: {p}" for p in want]
        expected = dataclasses.replace(TensorParallelMapping.plan(model, self.tp_size), build_id=self.build_id)
        return [f"tensor_parallel.{f.name}={getattr(self, f.name)!r}, but {model.architecture} over {self.tp_size} "
                f"rank(s) gives {getattr(expected, f.name)!r}"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(expected, f.name)]

    def rank_model(self, model: ModelConfig) -> ModelConfig:
        """``model`` as one rank computes it: its heads, KV heads and MLP slice (the vocabulary stays whole:
        every rank's engine returns the gathered logits)."""
        if self.tp_size == 1:
            return model
        return dataclasses.replace(model, num_heads=self.num_heads_per_rank, num_kv_heads=self.num_kv_heads_per_rank,
                                   intermediate_size=self.intermediate_size_per_rank)

    def kv_heads(self, rank: int) -> range:
        """The model's KV head ids rank ``rank`` holds (in its pool, in this order)."""
        if self.kv_head_replicas > 1:
            head = rank // self.kv_head_replicas
            return range(head, head + 1)
        return range(rank * self.num_kv_heads_per_rank, (rank + 1) * self.num_kv_heads_per_rank)

    def describe(self, model: ModelConfig) -> str:
        """One line for people (build-engine's summary, ``kiln inspect``)."""
        if self.tp_size == 1:
            return "1 rank (not sharded)"
        kv = f"{self.num_kv_heads_per_rank} KV head(s)"
        kv += (f" (each of the {model.num_kv_heads} replicated on {self.kv_head_replicas} ranks)"
               if self.kv_head_replicas > 1 else "")
        pad = self.vocab_size_per_rank * self.tp_size - model.vocab_size
        vocab = f"LM head {self.vocab_size_per_rank} vocab rows" + (f" ({pad} padding)" if pad else "")
        return (f"{self.tp_size} ranks, each: {self.num_heads_per_rank} heads, {kv}, MLP "
                f"{self.intermediate_size_per_rank}, {vocab} (vocab-parallel, logits all-gathered); "
                f"embedding {self.embedding}")


# ------------------------------------------------------------------------------------------ rank file stamps
def _archive_root(archive: zipfile.ZipFile) -> str:
    """The top folder every entry of a torch .pt2 archive sits under (torch refuses entries outside it)."""
    names = archive.namelist()
    return names[0].split("/", 1)[0] if names and "/" in names[0] else "archive"


def stamp_rank_file(path: str | Path, rank: int, mapping: TensorParallelMapping) -> None:
    """Record which rank of which build ``path`` holds, inside its archive (both torch loaders ignore it)."""
    with zipfile.ZipFile(path, "a") as archive:
        stamp = {"rank": rank, "tp_size": mapping.tp_size, "build_id": mapping.build_id}
        archive.writestr(f"{_archive_root(archive)}/{STAMP_NAME}", json.dumps(stamp))


def check_rank_file(directory: str | Path, mapping: TensorParallelMapping, rank: int, name: str) -> Path:
    """The path of rank ``rank``'s engine file, after checking it is there, is an archive, and holds that
    rank of this build; EngineLoadError naming the file otherwise. Reads the archive's directory only."""
    path = Path(directory) / name
    if not path.is_file():
        raise EngineLoadError(f"{path}: missing (rank {rank} of {mapping.tp_size}); the engine directory is "
                              "incomplete, rebuild it")
    if not zipfile.is_zipfile(path):
        raise EngineLoadError(f"{path}: corrupt engine file (not a .pt2 archive); rebuild the engine")
    try:
        with zipfile.ZipFile(path) as archive:
            stamp = json.loads(archive.read(f"{_archive_root(archive)}/{STAMP_NAME}"))
        found = (int(stamp["rank"]), int(stamp["tp_size"]), str(stamp["build_id"]))
    except (KeyError, ValueError, TypeError, zipfile.BadZipFile):
        raise EngineLoadError(f"{path}: carries no readable rank stamp ({STAMP_NAME}); it was not written by this "
                              "build-engine, rebuild the engine") from None
    want = (rank, mapping.tp_size, mapping.build_id)
    if found != want:
        raise EngineLoadError(f"{path}: holds rank {found[0]} of {found[1]} (build {found[2][:8]}), but config.json "
                              f"expects rank {rank} of {want[1]} (build {want[2][:8]}); the engine directory mixes "
                              "files of different ranks or builds, rebuild it")
    return path
