"""``kiln plan``: how many sequences an engine serves on a device, with which settings, and how many instances.

    kiln plan --engine DIR --device h100-80gb --trace trace.csv --rate 20 --ttft-p95 2s --tpot-p95 50ms
    kiln plan --hf-config llama-8b/config.json --dtype bfloat16 --device h200 --tp 2 --context-p95 8000 --output-p95 500
    kiln plan --engine DIR --device cpu:24 --calibration bench-out/result.json --trace trace.csv --prompt-scale 0.03
    kiln plan --engine DIR --device cpu:24 --calibration colocated/result.json --trace trace.csv --rate 4 \
        --ttft-p95 2s --tpot-p95 100ms --pd --pd-transfer pd-bench/result.json   # P prefill + D decode workers
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from kiln.bench.cli import _duration
from kiln.clikit import dataclass_options, given
from kiln.contract import ConfigError
from kiln.runtime.executor import ExecutorConfig

# the serving options the plan depends on are ExecutorConfig's fields (as for LLM(...)); the fraction is
# declared below with the planner's own default
_EXCLUDE = ("seed", "metrics_window", "enable_prefix_reuse", "kv_cache_memory_fraction", "speculative_config")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", "engine_dir", type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="A built engine (sizes from its memory plan).")
@click.option("--hf-config", type=click.Path(path_type=Path, exists=True),
              help="A Hugging Face config.json (or its directory) for a model not built yet.")
@click.option("--dtype", default="bfloat16", show_default=True, help="With --hf-config.")
@click.option("--quantization", default="none", show_default=True,
              help="With --hf-config: none, int8_weight_only, int4_weight_only.")
@click.option("--kv-cache-dtype", default="auto", show_default=True,
              help="With --hf-config: auto (the dtype), float32, bfloat16, float16, int8, fp8.")
@click.option("--max-seq-len", type=int, help="With --hf-config: the engine's max_seq_len (default: the model's).")
@click.option("--tokens-per-block", type=int, default=16, show_default=True, help="With --hf-config.")
@click.option("--device", help="h100-80gb, h200, a100-80gb, l4 or cpu:<GiB>.")
@click.option("--memory", help="Memory per device instead of the table's (e.g. 80GiB).")
@click.option("--bandwidth", type=float, help="Memory bandwidth in GB/s (overrides the device's).")
@click.option("--flops", type=float, help="Peak TFLOP/s (overrides the device's).")
@click.option("--tp", type=int, default=None,
              help="Tensor parallel: devices per instance (default: the engine's tp_size; 1 with --hf-config).")
@click.option("--trace", type=click.Path(path_type=Path, dir_okay=False), help="Workload lengths from a trace file.")
@click.option("--window", help="START:END seconds of the trace.")
@click.option("--max-requests", type=int, help="The first N requests of the trace (window).")
@click.option("--length-scale", type=float, help="Multiply trace lengths by F (as kiln bench).")
@click.option("--prompt-scale", type=float)
@click.option("--output-scale", type=float)
@click.option("--clip-to-engine", is_flag=True, help="Clip trace lengths so that every request fits the engine (as "
                                                   "kiln bench: prompt <= min(max_input_len, max_seq_len - 1), "
                                                   "output <= max_seq_len - prompt).")
@click.option("--context-p95", type=int, help="Prompt length p95 (without --trace).")
@click.option("--output-p95", type=int, help="Output length p95 (without --trace).")
@click.option("--context-mean", type=float, help="Prompt length mean (default: the p95).")
@click.option("--output-mean", type=float, help="Output length mean (default: the p95).")
@click.option("--rate", type=float, help="Requests/s to serve in total (for the instance count).")
@click.option("--ttft-p95", help="SLO: p95 time to first token (e.g. 2s).")
@click.option("--tpot-p95", help="SLO: p95 time per output token (e.g. 50ms).")
@dataclass_options(ExecutorConfig, exclude=_EXCLUDE)
@click.option("--kv-cache-memory-fraction", type=float,
              help="Share of the memory left after the weights given to the KV pool (as LLM(...) takes it); "
                   "default: the recommended one (headroom + activation peak kept free).")
@click.option("--headroom", type=float, default=0.10, show_default=True,
              help="Memory kept free for the recommended fraction.")
@click.option("--percentile", type=click.Choice(["50", "90", "95"]), default="95", show_default=True,
              help="Lengths the concurrency limit is planned for.")
@click.option("--calibration", type=click.Path(path_type=Path, dir_okay=False),
              help="A kiln bench result.json of this engine: measured bandwidth and FLOP/s replace the roofline's.")
@click.option("--pd", "pd", is_flag=True,
              help="Also plan disaggregated serving: P prefill + D decode workers for --rate within the SLO, "
                   "against colocated instances on the same hardware (needs --pd-transfer or --transfer-bandwidth).")
@click.option("--pd-transfer", type=click.Path(path_type=Path, dir_okay=False),
              help="A kiln bench result.json of a PD server (kiln serve --prefill-workers): its measured KV bytes per "
                   "block and transport bandwidth.")
@click.option("--transfer-bandwidth", type=float,
              help="KV transport bandwidth in GB/s instead of a measured one (bytes per block: the engine's).")
@click.option("--pd-max-workers", type=click.IntRange(min=2), default=64, show_default=True,
              help="Largest P + D (and colocated instance count) searched.")
@click.option("--speculative-config", "speculative_config",
              help="Plan speculation (JSON, as kiln serve takes it): a draft model's memory, and the time per output "
                   "token against plain decode.")
@click.option("--spec-acceptance",
              help="With --speculative-config: the per-position acceptance rate (0-1), or a kiln bench result.json "
                   "of a speculating server (its measured tokens per verify step).")
@click.option("--output", "out_path", type=click.Path(path_type=Path, dir_okay=False), help="Write the plan as JSON.")
def plan(engine_dir, hf_config, dtype, quantization, kv_cache_dtype, max_seq_len, tokens_per_block, device, memory,
         bandwidth, flops, tp, trace, window, max_requests, length_scale, prompt_scale, output_scale, clip_to_engine,
         context_p95, output_p95, context_mean, output_mean, rate, ttft_p95, tpot_p95, kv_cache_memory_fraction,
         headroom, percentile, calibration, pd, pd_transfer, transfer_bandwidth, pd_max_workers, speculative_config,
         spec_acceptance, out_path, **options):
    """Capacity plan: KV pool, concurrency limits, settings, step time and instances (every number with its source)."""
    from dataclasses import replace

    from kiln.bench import workload as wl
    from kiln.bench.cli import _window
    from kiln.bench.devices import Device, get_device, parse_bytes
    from kiln.bench.engine_facts import FactsError, engine_facts, hf_facts
    from kiln.bench.planner import PlanError, WorkloadStats, format_plan
    from kiln.bench.planner import plan as make_plan
    from kiln.bench.report import ResultError, read_result

    if (engine_dir is None) == (hf_config is None):
        raise click.UsageError("give one of --engine DIR or --hf-config PATH")
    serving = given(ExecutorConfig, options, exclude=_EXCLUDE)
    try:
        ExecutorConfig(**serving, kv_cache_memory_fraction=kv_cache_memory_fraction)   # the runtime's own checks
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    max_batch_size, max_num_tokens = serving.get("max_batch_size"), serving.get("max_num_tokens")
    try:
        if engine_dir is not None:
            facts = engine_facts(engine_dir)
        else:
            facts = hf_facts(hf_config, dtype, quantization, max_batch_size=max_batch_size or 256,
                             max_num_tokens=max_num_tokens or 8192, max_seq_len=max_seq_len,
                             tokens_per_block=tokens_per_block, kv_cache_dtype=kv_cache_dtype)
    except FactsError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        if device is None and memory is None:
            raise click.UsageError("give --device NAME or --memory SIZE")
        dev = get_device(device) if device else Device("custom", 0, 0.0, {"float32": 0.0}, None, "--memory")
        if memory:
            dev = replace(dev, memory_bytes=parse_bytes(memory), source=f"{dev.source}; memory from --memory {memory}")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if bandwidth:
        dev = replace(dev, bandwidth=bandwidth * 1e9, source=f"{dev.source}; bandwidth from --bandwidth")
    if flops:
        dev = replace(dev, flops={k: flops * 1e12 for k in ("float32", "bfloat16", "float16")},
                      source=f"{dev.source}; FLOP/s from --flops")
    if not dev.bandwidth and calibration is None:
        raise click.UsageError("a device given only by --memory needs --bandwidth and --flops (or --calibration)")

    if trace is not None:
        try:
            rows = wl.read_trace(trace)
            p_s = prompt_scale if prompt_scale is not None else (length_scale or 1.0)
            o_s = output_scale if output_scale is not None else (length_scale or 1.0)
            work = wl.trace_workload(rows, window=_window(window), max_requests=max_requests, prompt_scale=p_s,
                                     output_scale=o_s, source=str(trace))
            if clip_to_engine:
                work = wl.clip_to_bounds(work, facts.bounds.max_input_len, facts.bounds.max_seq_len)
                click.echo(wl.clip_summary(work.description["clip"]), err=True)
        except (wl.TraceError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        clip = work.description.get("clip")
        src = f"trace {trace}: {len(work.requests)} requests, prompt x{p_s:g}, output x{o_s:g}" + (
            f", {clip['requests_clipped']} clipped to fit the engine" if clip else "")
        stats = WorkloadStats.from_lengths([r.prompt_len for r in work.requests],
                                           [r.output_len for r in work.requests], src)
    elif context_p95 is not None and output_p95 is not None:
        stats = WorkloadStats.from_percentiles(context_p95, output_p95, context_mean, output_mean)
    else:
        raise click.UsageError("give --trace FILE or --context-p95 N --output-p95 N")

    cal = None
    if calibration is not None:
        try:
            cal = read_result(calibration).get("calibration")
        except ResultError as exc:
            raise click.ClickException(str(exc)) from None
        if not cal or "bandwidth_bytes_per_s" not in cal:
            raise click.ClickException(f"{calibration}: the result has no step-time fit of an engine (run kiln bench "
                                       "with --engine DIR, or against kiln serve with --engine DIR for the facts)")
    transport = None
    if pd:
        from kiln.bench.pd_plan import Transport, transport_from_result

        per_block = facts.kv_bytes_per_token * facts.bounds.tokens_per_block
        if (pd_transfer is None) == (transfer_bandwidth is None):
            raise click.UsageError("--pd needs --pd-transfer RESULT.json (measured) or --transfer-bandwidth GB/s")
        if transfer_bandwidth is not None:
            if not transfer_bandwidth > 0:
                raise click.BadParameter(f"--transfer-bandwidth must be > 0 GB/s, got {transfer_bandwidth:g}")
            transport = Transport(per_block, transfer_bandwidth * 1e9, "--transfer-bandwidth; bytes per block: "
                                                                       "the engine's KV bytes per token x block")
        else:
            try:
                transport = transport_from_result(pd_transfer, per_block)
            except (PlanError, ResultError) as exc:
                raise click.ClickException(str(exc)) from None
    elif pd_transfer is not None or transfer_bandwidth is not None:
        raise click.UsageError("--pd-transfer and --transfer-bandwidth go with --pd")
    speculation = _speculation(speculative_config, spec_acceptance, facts)
    try:
        fraction = "recommended" if kv_cache_memory_fraction is None else kv_cache_memory_fraction
        result = make_plan(facts, dev, stats, tp=tp, kv_cache_memory_fraction=fraction, headroom=headroom,
                           percentile=int(percentile), calibration=cal, rate=rate, slo_ttft_p95=_duration(ttft_p95),
                           slo_tpot_p95=_duration(tpot_p95), pd_transport=transport, pd_max_workers=pd_max_workers,
                           speculation=speculation, **serving)
    except PlanError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(format_plan(result))
    if "pd" in result:
        from kiln.bench.pd_plan import format_pd

        click.echo(format_pd(result["pd"]))
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"kiln_plan": 1, "engine": facts.as_dict(), "plan": result,
                                        "clip": clip if trace is not None else None}, indent=1))
        click.echo(f"plan: {out_path}")


def _speculation(value: str | None, acceptance: str | None, target):
    """--speculative-config (checked as the runtime checks it) and --spec-acceptance -> SpeculationInputs."""
    from kiln.bench.engine_facts import FactsError, engine_facts
    from kiln.bench.planner import PlanError
    from kiln.bench.spec_plan import SpeculationInputs, parse_acceptance
    from kiln.runtime.speculative import SpeculativeConfig

    if value is None:
        if acceptance is not None:
            raise click.UsageError("--spec-acceptance goes with --speculative-config")
        return None
    try:
        spec = SpeculativeConfig.of(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--speculative-config") from None
    draft = None
    if spec.method == "draft_model":
        try:
            draft = engine_facts(spec.model)
        except FactsError as exc:
            raise click.BadParameter(f"the draft: {exc}", param_hint="--speculative-config") from None
        if draft.vocab_size != target.vocab_size:   # the runtime refuses this draft (draft_model.check_compatible)
            raise click.BadParameter(f"the draft engine {spec.model} has a vocabulary of {draft.vocab_size} tokens, "
                                     f"the target {target.name} {target.vocab_size}: a draft must share the "
                                     "target's tokenizer", param_hint="--speculative-config")
    try:
        acc = parse_acceptance(acceptance) if acceptance is not None else None
    except PlanError as exc:
        raise click.BadParameter(str(exc), param_hint="--spec-acceptance") from None
    return SpeculationInputs(spec.method, spec.num_speculative_tokens, acc, draft)
