"""build_engine: checkpoint directory -> engine directory (the only thing that passes to the runtime).

Stages: load -> trace -> passes -> kv_accuracy (an 8-bit KV cache's accuracy report, run on the graph after
the passes: :mod:`kiln.builder.kv_accuracy`) -> re-export -> memory plan -> compile -> write. Each stage is
timed; ``progress(stage, message)`` is called as stages start ("start", or "start rank r/N") and end.

Tensor parallelism (``tp_size`` > 1): the checkpoint is loaded once, then each rank's shard of the weights
(``kiln.model_defs.shard_weights``) goes through trace -> passes -> export -> memory plan -> compile on its
own, so the fusion passes and weight-only quantization see (and quantize) one rank's shard; the rank's
graph holds its collectives (``kiln::all_reduce`` after each row-parallel GEMM, ``kiln::all_gather`` of the
logits). Every rank file is stamped with its rank and the build's id. ``memory`` in config.json is rank 0's
(every rank has the same shapes).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from kiln.builder import kv_accuracy, memory_plan, trace
from kiln.builder import lora as lora_graph
from kiln.builder.backends import BACKENDS
from kiln.builder.config import BuildConfig
from kiln.builder.passes import PassContext, check_names, run_passes
from kiln.builder.passes.common import count_gemms
from kiln.contract import (
    FORMAT_VERSION,
    QUANTIZED_KV_DTYPES,
    REPORT_FILE,
    TOKENIZER_FILES,
    TORCH_BACKENDS,
    BuildConfigError,
    EngineBuildError,
    EngineConfig,
    MemorySummary,
    ModelConfig,
    TensorParallelMapping,
    TokenizerInfo,
    file_checksum,
    is_engine_dir,
    kv_bytes_per_token,
    rank_file,
    save_weights,
    stamp_rank_file,
    torch_dtype,
    weights_file,
)

STAGES = ("load", "trace", "passes", "kv_accuracy", "export", "memory_plan", "compile", "write")
# why a tensor-parallel build has no accuracy report (a rank's graph computes only its shard)
TP_ACCURACY_SKIPPED = ("tensor-parallel build: a rank's graph computes its shard only; build with tp_size 1 for the "
                       "report (a token's 8-bit rows are the same bytes on any split)")
# why an engine that takes LoRA adapters has none (its graph needs the adapter inputs)
LORA_ACCURACY_SKIPPED = ("LoRA engine: the report runs the base model's graph; build the same checkpoint without "
                         "lora_target_modules for it (the adapters do not change how KV rows are quantized)")

Progress = Callable[[str, str], None]


def _accuracy_skipped(build: BuildConfig) -> str | None:
    """Why this build can have no 8-bit KV accuracy report (None: it can)."""
    if build.tp_size > 1:
        return TP_ACCURACY_SKIPPED
    return LORA_ACCURACY_SKIPPED if build.lora_target_modules else None


def stages(build: BuildConfig) -> tuple[str, ...]:
    """The stages ``build`` runs, in order (kv_accuracy only for an 8-bit KV cache on one rank, no adapters)."""
    accuracy = build.resolved_kv_cache_dtype in QUANTIZED_KV_DTYPES and _accuracy_skipped(build) is None
    return tuple(s for s in STAGES if s != "kv_accuracy" or accuracy)


def kiln_version() -> str:
    try:
        return metadata.version("kiln-llm")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


def special_tokens(ckpt: Path) -> tuple[list[int], int | None]:
    """eos ids (a list: Llama 3 has several) and the bos id, from generation_config.json, else config.json."""
    eos: Any = None
    bos: Any = None
    for name in ("generation_config.json", "config.json"):
        path = ckpt / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        if eos is None:
            eos = data.get("eos_token_id")
        if bos is None:
            bos = data.get("bos_token_id")
    if eos is None:
        eos_ids: list[int] = []
    elif isinstance(eos, list):
        eos_ids = [int(e) for e in eos]
    else:
        eos_ids = [int(eos)]
    return eos_ids, (int(bos) if bos is not None else None)


@contextmanager
def _stage(name: str, timings: dict[str, float], progress: Progress | None, rank: str = ""):
    if progress:
        progress(name, f"start {rank}".strip())
    t0 = time.perf_counter()
    yield
    took = time.perf_counter() - t0
    timings[name] = round(timings.get(name, 0.0) + took, 3)   # summed over the ranks
    if progress:
        progress(name, f"done in {took:.2f} s")


def _check_output_dir(ckpt: Path, out: Path) -> None:
    """The output is replaced wholesale: refuse anything that is not an engine directory we wrote, or a path
    that cannot become a directory (checked before any stage runs, named as the user gave it)."""
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise EngineBuildError(f"output {out}: {above} is not a directory; choose another --output")
    c, o = ckpt.resolve(), out.resolve()
    if o == c or o in c.parents:
        raise EngineBuildError(f"output directory {out} would replace the checkpoint {ckpt}; choose another --output")
    if out.exists():
        if not out.is_dir():
            raise EngineBuildError(f"output {out} exists and is not a directory")
        if any(out.iterdir()) and not is_engine_dir(out):
            raise EngineBuildError(
                f"output directory {out} is not empty and does not hold a kiln engine; "
                "refusing to replace it (choose an empty or new directory)"
            )


def program_weights(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Every tensor the program reads, by the name its graph (and a package compiled from it) uses."""
    return {**ep.state_dict, **{k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}}


def build_engine(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    build: BuildConfig | None = None,
    progress: Progress | None = None,
) -> Path:
    """Build the engine of ``checkpoint_dir`` into ``output_dir`` (created or overwritten); returns it."""
    from kiln.model_defs import checkpoint_quantization, load_config

    build = (build or BuildConfig()).validate()
    check_names(build.disabled_passes)
    ckpt, out = Path(checkpoint_dir), Path(output_dir)
    _check_output_dir(ckpt, out)
    model = load_config(ckpt)
    build.check_model(model)
    lora = lora_graph.plan(build, model)   # its target names checked before any stage runs
    if build.tp_size > 1 and checkpoint_quantization(ckpt) is not None:
        raise BuildConfigError(f"{ckpt} is pre-quantized (GPTQ / AWQ): tensor parallelism does not split its int4 "
                               "weights yet; build with tp_size 1")
    calibration = (kv_accuracy.calibration_file_prompts(build.kv_calibration, ckpt, kv_accuracy.max_prompt_len(build))
                   if build.kv_calibration else None)   # a bad file fails here, before any stage
    tmp = _make_build_dir(out)
    try:
        return _build(ckpt, out, tmp, build, model, lora, progress, calibration)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_build_dir(out: Path) -> Path:
    """The directory the engine is written into before it replaces ``out``; made before the first stage, so an
    output where nothing can be created fails at once, not after minutes of tracing and exporting."""
    tmp = out.with_name(out.name + ".tmp-build")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise EngineBuildError(f"output {out}: cannot create {tmp} ({exc.strerror}); choose an --output in a "
                               "directory you can write to") from None
    return tmp


def _build(ckpt: Path, out: Path, tmp: Path, build: BuildConfig, model, lora: lora_graph.LoraPlan | None,
           progress: Progress | None, calibration: list[list[int]] | None) -> Path:
    """The stages, writing into ``tmp``, which then replaces ``out``."""
    from kiln.model_defs import checkpoint_quantization, load_checkpoint, parameter_counts

    timings: dict[str, float] = {}
    t_total = time.perf_counter()
    mapping = TensorParallelMapping.plan(model, build.tp_size)
    with _stage("load", timings, progress):
        _, weights = load_checkpoint(ckpt, build.dtype)
    measure = (calibration, special_tokens(ckpt)[1]) if "kv_accuracy" in stages(build) else None
    ranks = [_build_rank(model, weights, mapping, rank, build, lora, tmp, timings, progress, measure)
             for rank in range(mapping.tp_size)]
    first = ranks[0]
    arena = first["memory_plan"]
    kv_bytes = kv_bytes_per_token(mapping.rank_model(model), build.resolved_kv_cache_dtype)
    total_params, active_params = parameter_counts(model)
    summary = MemorySummary(
        weights_bytes=first["weights_bytes"],
        activation_peak_bytes=arena["activation_peak_bytes"],
        activation_live_peak_bytes=arena["live_peak_bytes"],
        activation_naive_bytes=arena["naive_bytes"],
        num_buffers=arena["num_buffers"],
        kv_bytes_per_token=kv_bytes,
        kv_tokens_per_gib=(1 << 30) // kv_bytes,
        total_params=total_params,
        active_params=active_params,
        decode_read_bytes=first["decode_read_bytes"],
        gathered_weights=first["gathered_weights"],
    )
    engine_files = [rank_file(r) for r in range(mapping.tp_size)]
    with _stage("write", timings, progress):
        eos_ids, bos_id = special_tokens(ckpt)
        copied = []
        for name in TOKENIZER_FILES:
            if (ckpt / name).is_file():
                shutil.copy2(ckpt / name, tmp / name)
                copied.append(name)
        resolved = build.resolved()
        # every file the runtime reads: the engine files (every rank's, stamped), the weights files, a backend's
        # side files (an ONNX model's external weights), the tokenizer files (config.json and build_report.json
        # are not written yet); the engine files first, so that a directory missing everything is reported by
        # its rank 0 file
        names = [*engine_files, *sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name not in engine_files)]
        checksums = {name: file_checksum(tmp / name) for name in names}
        EngineConfig(
            format_version=FORMAT_VERSION, torch_version=torch.__version__, kiln_version=kiln_version(),
            backend=build.backend, dtype=build.dtype, kv_cache_dtype=resolved.kv_cache_dtype,
            quantization=build.quantization, model=model, bounds=build.engine_bounds(), memory=summary,
            tokenizer=TokenizerInfo(files=copied, eos_token_ids=eos_ids, bos_token_id=bos_id),
            engine_files=engine_files, tensor_parallel=mapping, checksums=checksums, build=resolved.to_dict(),
            lora=lora.layout if lora is not None else None,
        ).write(tmp)
    timings["total"] = round(time.perf_counter() - t_total, 3)
    report = {
        "checkpoint": str(ckpt.resolve()),
        "timings_s": timings,
        "gemms": first["gemms"],
        "passes": first["passes"],
        "backend": first["backend"],
        "memory": dataclasses.asdict(summary),
        "memory_plan": arena,
    }
    if lora is not None:   # the adapter pool is the runtime's (max_loras slots); what one slot takes
        report["lora"] = {"modules": [m.name for m in lora.layout.modules], "max_rank": lora.layout.max_rank,
                          "adapted_linears": len(lora.segments),
                          "slot_bytes": lora.layout.slot_bytes(torch_dtype(build.dtype))}
    pq = checkpoint_quantization(ckpt)
    if pq is not None:   # its linears are int4 panels as the checkpoint stored them (not re-quantized)
        report["prequantized"] = {"method": pq.method, "group_size": pq.group_size, "bits": 4}
    if measure is not None:
        report["kv_cache_accuracy"] = first["kv_cache_accuracy"]
    elif build.resolved_kv_cache_dtype in QUANTIZED_KV_DTYPES:
        report["kv_cache_accuracy"] = {"kv_cache_dtype": build.resolved_kv_cache_dtype,
                                       "skipped": _accuracy_skipped(build)}
    if mapping.tp_size > 1:   # the sections above are rank 0's
        report["tensor_parallel"] = {
            "mapping": dataclasses.asdict(mapping),
            "ranks": [{"rank": r, "weights_bytes": x["weights_bytes"], "gemms": x["gemms"],
                       "activation_peak_bytes": x["memory_plan"]["activation_peak_bytes"]}
                      for r, x in enumerate(ranks)],
        }
    (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out

def _build_rank(model: ModelConfig, weights: dict[str, torch.Tensor], mapping: TensorParallelMapping, rank: int,
                build: BuildConfig, lora: lora_graph.LoraPlan | None, out: Path, timings: dict[str, float],
                progress: Progress | None,
                measure: tuple[list[list[int]] | None, int | None] | None = None) -> dict[str, Any]:
    """trace -> passes -> (kv_accuracy) -> export -> memory plan -> compile of rank ``rank``'s shard into
    ``out / rank{rank}.engine``; what the report and config.json need of it. The last rank empties ``weights``
    once its shard is cut, so that the passes can free what they replace (with one rank the module holds the
    checkpoint's tensors). ``measure`` (calibration prompts or None, bos id): run the 8-bit KV accuracy report
    on the graph after the passes (the engine's own kernels)."""
    from kiln.model_defs import build_model, shard_weights

    label = f"rank {rank + 1}/{mapping.tp_size}" if mapping.tp_size > 1 else ""
    rank_model = mapping.rank_model(model)    # this rank's heads: the shape of its KV pool input
    with _stage("trace", timings, progress, label):
        shard = shard_weights(model, weights, mapping, rank)
        if rank == mapping.tp_size - 1:
            weights.clear()
        module = build_model(model, shard, mapping)
        del shard
        layout = None
        if lora is not None:   # the targeted linears add each token's adapter (the contract's adapter inputs)
            module, layout = lora_graph.LoraModel(module, lora), lora.layout
        ep = trace.export(module, rank_model, build, layout)
    with _stage("passes", timings, progress, label):
        gm = ep.module()
        gemms_before = count_gemms(gm)
        ctx = PassContext(build=build, model=model)
        pass_stats = run_passes(gm, ctx, build.disabled_passes)
        gemms_after = count_gemms(gm)
        del module, ep
    accuracy = None
    if measure is not None:
        with _stage("kv_accuracy", timings, progress, label):
            accuracy = kv_accuracy.kv_accuracy(gm, model, build, *measure)
    with _stage("export", timings, progress, label):
        ep = trace.export(gm, rank_model, build, layout)
        del gm
    with _stage("memory_plan", timings, progress, label):
        arena = memory_plan.plan(ep)
        weights_bytes = memory_plan.weights_bytes(ep)
        decode_read = memory_plan.decode_read_bytes(ep)
        gathered = memory_plan.gathered_weights(ep)
    with _stage("compile", timings, progress, label):
        path = out / rank_file(rank)
        backend = BACKENDS[build.backend]
        backend_stats = backend.compile(ep, path, trace.example_inputs(rank_model, build, layout), build)
        if getattr(backend, "SEPARATE_WEIGHTS", False):   # the graph holds none: rank{r}.weights, mapped at load
            backend_stats["weights_bytes"] = save_weights(program_weights(ep), out / weights_file(rank))
        if build.backend in TORCH_BACKENDS:   # a .pt2 archive (an ONNX model or TensorRT plan has no place for it)
            stamp_rank_file(path, rank, mapping)
    return {"gemms": {"before_passes": gemms_before, "after_passes": gemms_after}, "passes": pass_stats,
            "backend": backend_stats, "memory_plan": arena, "weights_bytes": weights_bytes,
            "decode_read_bytes": decode_read, "gathered_weights": gathered, "kv_cache_accuracy": accuracy}
