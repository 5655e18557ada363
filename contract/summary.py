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


def summary_rows(config: EngineConfig, report: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(label, value) rows of an engine; ``report`` (build_report.json) adds GEMM counts and build time."""
    m, b, mem = config.model, config.bounds, config.memory
    rows = [
        ("model", f"{m.architecture} ({m.num_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size})"),
        ("backend / dtype", f"{config.backend} / {config.dtype} (kv {config.kv_cache_dtype}, "
                            f"quantization {config.quantization})"),
        ("limits", f"batch {b.max_batch_size}, tokens/step {b.max_num_tokens}, seq {b.max_seq_len}, "
                   f"block {b.tokens_per_block}"),
        ("weights", human_bytes(mem.weights_bytes)),
        ("activation peak", f"{human_bytes(mem.activation_peak_bytes)} "
                            f"(no reuse: {human_bytes(mem.activation_naive_bytes)})"),
        ("KV bytes/token", f"{mem.kv_bytes_per_token} B"),
        ("KV tokens in 1 GiB", f"{mem.kv_tokens_per_gib:,}"),
    ]
    if report:
        rows.append(("GEMMs before/after passes",
                     f"{report['gemms']['before_passes']} -> {report['gemms']['after_passes']}"))
        rows.append(("build time", f"{report['timings_s'].get('total', 0):.1f} s"))
    rows.append(("format / kiln / torch", f"{config.format_version} / {config.kiln_version} / {config.torch_version}"))
    rows.append(("eos / bos token ids", f"{config.tokenizer.eos_token_ids} / {config.tokenizer.bos_token_id}"))
    return rows


def format_table(rows: list[tuple[str, str]]) -> str:
    """Rows as a two-column text table between rules."""
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k:<{width}} | {v}" for k, v in rows), line])
