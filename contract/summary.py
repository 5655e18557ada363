"""The summary of an engine that ``build-engine`` prints after a build and ``kiln inspect`` prints later."""

from __future__ import annotations

from typing import Any

from kiln.contract.engine_config import EngineConfig


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def parameters(config: EngineConfig) -> str:
    """Total parameters and, for an MoE model, those one token uses."""
    m, mem = config.model, config.memory
    if not m.is_moe:
        return count(mem.total_params)
    return (f"{count(mem.total_params)} total, {count(mem.active_params)} active per token ({m.num_experts_per_tok} "
            f"of {m.num_experts} experts in {len(m.moe_layers)} of {m.num_layers} layers)")


def summary_rows(config: EngineConfig, report: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(label, value) rows of an engine; ``report`` (build_report.json) adds GEMM counts and build time."""
    m, b, mem, tp = config.model, config.bounds, config.memory, config.tp_size
    per_rank = " per rank" if tp > 1 else ""
    kv = config.kv_bytes_per_token     # one rank's
    kv_all = f" ({kv * tp} B over {tp} ranks)" if tp > 1 else ""
    rows = [
        ("model", f"{m.architecture} ({m.num_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size})"),
        ("backend / dtype", f"{config.backend} / {config.dtype} (kv {config.kv_cache_dtype}, "
                            f"quantization {config.quantization})"),
        ("limits", f"batch {b.max_batch_size}, tokens/step {b.max_num_tokens}, seq {b.max_seq_len}, "
                   f"block {b.tokens_per_block}"),
        *([("parameters", parameters(config))] if mem.total_params else []),
        ("weights", human_bytes(mem.weights_bytes) + per_rank),
        *([("decode reads", f"{human_bytes(mem.decode_read_bytes)} of weights per step of one sequence{per_rank}")]
          if mem.decode_read_bytes else []),
        ("activation peak", f"{human_bytes(mem.activation_peak_bytes)} "
                            f"(no reuse: {human_bytes(mem.activation_naive_bytes)})"),
        ("tensor parallel", config.tensor_parallel.describe(m)),
        ("KV bytes/token", f"{kv} B{per_rank}{kv_all}"),
        ("KV tokens in 1 GiB", f"{(1 << 30) // kv:,}{per_rank}"),
    ]
    if config.lora is not None:
        lo = config.lora
        rows.append(("LoRA", f"max rank {lo.max_rank}, modules {', '.join(m.name for m in lo.modules)}; "
                             f"{human_bytes(lo.slot_bytes(config.torch_dtype))} per adapter slot"))
    if report:
        rows.extend(backend_rows(report.get("backend") or {}))
        if report.get("kv_cache_accuracy"):
            rows.append(("KV cache accuracy", kv_accuracy_row(report["kv_cache_accuracy"])))
        rows.append(("GEMMs before/after passes",
                     f"{report['gemms']['before_passes']} -> {report['gemms']['after_passes']}"))
        rows.append(("build time", f"{report['timings_s'].get('total', 0):.1f} s"))
    rows.append(("format / kiln / torch", f"{config.format_version} / {config.kiln_version} / {config.torch_version}"))
    rows.append(("eos / bos token ids", f"{config.tokenizer.eos_token_ids} / {config.tokenizer.bos_token_id}"))
    return rows


def kv_accuracy_row(acc: dict[str, Any]) -> str:
    """The build report's 8-bit KV accuracy in one line."""
    if acc.get("skipped"):
        return f"not measured: {acc['skipped']}"
    return (f"{acc['kv_cache_dtype']} vs {acc['reference_kv_cache_dtype']} pool, {acc['positions']} positions of "
            f"{acc['calibration']}: top-1 agreement {100 * acc['top1_agreement']:.1f}%, logit error max "
            f"{acc['max_abs_logit_error']:.3g} / mean {acc['mean_abs_logit_error']:.3g}")


def format_table(rows: list[tuple[str, str]]) -> str:
    """Rows as a two-column text table between rules."""
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k:<{width}} | {v}" for k, v in rows), line])


def _ops(facts: dict[str, Any], top: int = 8) -> str:
    ops = facts.get("nodes_by_op_type", {})
    shown = ", ".join(f"{k} {v}" for k, v in list(ops.items())[:top])
    more = f", +{len(ops) - top} more types" if len(ops) > top else ""
    return f"opset {facts.get('opset')}, {facts.get('num_nodes')} nodes: {shown}{more}"


def backend_rows(facts: dict[str, Any]) -> list[tuple[str, str]]:
    """What the build report says of an onnx model or a TensorRT plan (nothing for the torch backends)."""
    rows: list[tuple[str, str]] = []
    if facts.get("format") == "onnx":
        rows.append(("onnx graph", _ops(facts)))
        rows.append(("onnx file", f"{human_bytes(facts.get('file_bytes', 0))}"
                                  + (f", weights in {facts['external_data']}" if facts.get("external_data") else "")))
        if facts.get("dequantize_nodes"):
            rows.append(("weight-only GEMMs", f"{facts['dequantize_nodes']} DequantizeLinear "
                                              f"({facts.get('dequantize_on_initializers')} on initializers)"))
    elif facts.get("format") == "tensorrt-plan":
        rows.append(("tensorrt plan", f"{human_bytes(facts.get('plan_bytes', 0))}, {facts.get('module')} "
                                      f"{facts.get('version')}, built in {facts.get('build_s', 0):.1f} s, "
                                      f"{facts.get('precision', '')}"))
        net = facts.get("network", {})
        rows.append(("tensorrt network", f"{net.get('num_layers')} layers, "
                                         f"{len(facts.get('engine_layers', []))} engine layers"))
        for i, profile in enumerate(facts.get("profiles", [])):
            dims = ", ".join(f"{k} {lo}..{hi} (opt {opt})" for k, (lo, opt, hi) in profile["dims"].items())
            rows.append((f"profile {i}", dims))
        if facts.get("onnx"):
            rows.append(("onnx graph", _ops(facts["onnx"])))
    return rows
