"""``kiln bench``: replay a trace or a synthetic workload against an engine or a server, sweep rates, find the knee.

    kiln bench --engine DIR --trace trace.csv --length-scale 0.05 --rates 0.5,1,2 --slo-ttft-p95 2s --output out/
    kiln bench --endpoint http://localhost:8000 --api openai --engine DIR --sweep auto --output out/
    kiln bench --endpoint 127.0.0.1:8001 --api triton --engine DIR --rate 2 --output out/  # serve --frontend triton
    kiln bench --dry-run --rates 10,50 --num-requests 500 --output out/    # the client against a zero-latency stub
    kiln bench compare out-a/result.json out-b/result.json
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import click

from kiln.bench.stats import SLO
from kiln.clikit import dataclass_options, given
from kiln.contract import KilnError
from kiln.runtime.executor import ExecutorConfig

# serving options of the in-process target are ExecutorConfig's fields (as for kiln generate); --seed is the
# workload's, and the bench keeps every step record
_EXECUTOR_EXCLUDE = ("seed", "metrics_window")


def _duration(text: str | None) -> float | None:
    """'1.5', '1.5s' or '1500ms' -> seconds."""
    if text is None:
        return None
    t = text.strip().lower()
    try:
        if t.endswith("ms"):
            return float(t[:-2]) / 1e3
        return float(t[:-1] if t.endswith("s") else t)
    except ValueError:
        raise click.BadParameter(f"{text!r}: use seconds (1.5, 1.5s) or milliseconds (1500ms)") from None


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"--rates {text!r}: comma-separated numbers, e.g. 0.5,1,2") from None
    if not rates or any(r <= 0 for r in rates):
        raise click.BadParameter(f"--rates {text!r}: at least one rate, each > 0")
    return rates


def _window(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        lo, hi = (float(x) for x in text.split(":", 1))
    except ValueError:
        raise click.BadParameter(f"--window {text!r}: START:END in seconds from the trace's start") from None
    if hi <= lo:
        raise click.BadParameter(f"--window {text!r}: END must be after START")
    return lo, hi


def _pair(text: str | None, name: str) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        n, length = (int(x) for x in text.split(":", 1))
    except ValueError:
        raise click.BadParameter(f"{name} {text!r}: N:L (N prompts of L tokens)") from None
    return n, length


def _vocab_and_specials(engine_dir: Path | None, tokenizer: Path | None,
                        vocab_size: int | None) -> tuple[int, set[int], str]:
    """Vocabulary size and special token ids to avoid in synthetic prompts, and where they came from."""
    specials: set[int] = set()
    tok_path = None
    if tokenizer is not None:
        tok_path = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    elif engine_dir is not None and (engine_dir / "tokenizer.json").is_file():
        tok_path = engine_dir / "tokenizer.json"
    size, source = None, None
    if tok_path is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_path))
        size, source = tok.get_vocab_size(), f"tokenizer {tok_path}"
        specials |= {int(i) for i in tok.get_added_tokens_decoder()}
    if engine_dir is not None:
        from kiln.bench.engine_facts import engine_facts

        facts = engine_facts(engine_dir)
        size = min(size, facts.vocab_size) if size else facts.vocab_size
        source = source or f"engine {engine_dir}"
        specials |= set(facts.special_token_ids)
    if vocab_size is not None:
        size, source = vocab_size, "--vocab-size"
    if size is None:
        raise click.UsageError("prompts are token ids: give --engine DIR, --tokenizer PATH or --vocab-size N")
    return size, specials, source


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", "engine_dir", type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="Engine directory: the in-process target, or (with --endpoint) the served engine's facts.")
@click.option("--endpoint", help="Base URL of an OpenAI-compatible server (e.g. http://127.0.0.1:8000), or with "
                                 "--api triton Triton's gRPC address (e.g. 127.0.0.1:8001).")
@click.option("--api", type=click.Choice(["openai", "triton"]), default="openai", show_default=True,
              help="Protocol of --endpoint: openai = streaming /v1/completions; triton = gRPC streaming to kiln's "
                   "Triton model (kiln serve --frontend triton; needs the kiln-llm[triton] extra).")
@click.option("--model", help="Model name sent to the endpoint (default: openai: the first of /v1/models; "
                              "triton: kiln).")
@click.option("--api-key", envvar="KILN_API_KEY", help="Sent as 'Authorization: Bearer KEY' to --endpoint.")
@click.option("--metrics-url", help="Prometheus metrics of the target (default: openai: ENDPOINT/metrics, triton: "
                                    "none; 'none' to skip).")
@click.option("--no-force-lengths", is_flag=True, help="Do not send ignore_eos/min_tokens (servers that reject them).")
@click.option("--dry-run", is_flag=True, help="Target a zero-latency stub server: measures the client itself.")
@click.option("--trace", type=click.Path(path_type=Path, dir_okay=False),
              help="CSV/JSONL trace: arrival, prompt and output lengths.")
@click.option("--window", help="START:END seconds of the trace to replay.")
@click.option("--max-requests", type=int, help="Replay at most N requests (of the window).")
@click.option("--rate-scale", type=float, default=1.0, show_default=True,
              help="Single run of a trace: replay at the trace's own rate x F (ignored with --rates / --sweep).")
@click.option("--length-scale", type=float, help="Multiply prompt and output lengths by F.")
@click.option("--prompt-scale", type=float, help="Multiply prompt lengths by F (overrides --length-scale).")
@click.option("--output-scale", type=float, help="Multiply output lengths by F (overrides --length-scale).")
@click.option("--clip-to-engine", is_flag=True, help="Clip lengths so that every request fits the engine: prompt <= "
                                                   "min(max_input_len, max_seq_len - 1), output <= max_seq_len - "
                                                   "prompt (the counts are printed and stored).")
@click.option("--num-requests", type=int, default=100, show_default=True, help="Synthetic workload: requests per rate.")
@click.option("--prompt-len", help="Synthetic: N, LOW:HIGH or 'trace' (the trace's lengths). [default: 128]")
@click.option("--output-len", help="Synthetic: N, LOW:HIGH or 'trace' (the trace's lengths). [default: 128]")
@click.option("--burstiness", type=float, default=1.0, show_default=True,
              help="Synthetic arrivals: gamma shape (1 = Poisson, < 1 burstier).")
@click.option("--shared-prefix", help="N:L: every prompt starts with one of N system prompts of L tokens.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tokenizer", type=click.Path(path_type=Path, exists=True),
              help="tokenizer.json (vocabulary for prompts).")
@click.option("--vocab-size", type=int, help="Vocabulary size for prompts when no tokenizer/engine is given.")
@click.option("--rate", type=float, help="One run at R req/s.")
@click.option("--rates", help="A sweep: comma-separated req/s, e.g. 0.5,1,2,4.")
@click.option("--sweep", type=click.Choice(["auto"]),
              help="auto: double the rate until the SLO breaks, then bisect once.")
@click.option("--start-rate", type=float, default=0.5, show_default=True, help="First rate of --sweep auto.")
@click.option("--max-throughput", is_flag=True, help="Every request at t=0.")
@click.option("--slo-ttft-p95", help="SLO on p95 time to first token (e.g. 2s, 500ms).")
@click.option("--slo-tpot-p95", help="SLO on p95 time per output token (e.g. 100ms).")
@dataclass_options(ExecutorConfig, exclude=_EXECUTOR_EXCLUDE)
@click.option("--threads", type=int, help="In-process: torch threads (default: torch's).")
@click.option("--warmup", type=int, default=2, show_default=True, help="Unmeasured requests sent first.")
@click.option("--timeout", "run_timeout", type=float, help="Seconds per rate before the rest is aborted.")
@click.option("--request-timeout", type=float, help="HTTP: seconds per request.")
@click.option("--output", "out_dir", type=click.Path(path_type=Path, file_okay=False), default=Path("bench-out"),
              show_default=True, help="Directory for result.json and the PNG plots.")
@click.option("--no-plots", is_flag=True)
@click.option("--no-progress", is_flag=True)
@click.pass_context
def bench(ctx, engine_dir, endpoint, api, model, api_key, metrics_url, no_force_lengths, dry_run, trace, window,
          max_requests, rate_scale, length_scale, prompt_scale, output_scale, clip_to_engine, num_requests,
          prompt_len, output_len, burstiness, shared_prefix, seed, tokenizer, vocab_size, rate, rates, sweep,
          start_rate, max_throughput, slo_ttft_p95, slo_tpot_p95, threads, warmup, run_timeout, request_timeout,
          out_dir, no_plots, no_progress, **options):
    """Replay load against an engine (--engine) or a server (--endpoint); sweep rates; report and plot."""
    if ctx.invoked_subcommand is not None:
        return
    prep = prepare(ctx.params, targets=sum(bool(x) for x in (endpoint, dry_run))
                   + (engine_dir is not None and not endpoint and not dry_run))
    if threads:
        import torch

        torch.set_num_threads(threads)
    load_start = os.getloadavg()[0]
    t0 = time.time()
    if dry_run:
        from kiln.bench.stub_server import running_stub

        with running_stub() as url:
            runs = asyncio.run(run_target(prep, _OpenAI(url, model=None, request_timeout=request_timeout)))
    elif endpoint and api == "triton":
        from kiln.bench.targets import TritonTarget

        mu = None if metrics_url in (None, "none") else metrics_url
        try:
            target = TritonTarget(endpoint, model=model, metrics_url=mu, request_timeout=request_timeout,
                                  force_lengths=not no_force_lengths)
        except ConnectionError as exc:
            raise click.ClickException(str(exc)) from None
        runs = asyncio.run(run_target(prep, target))
    elif endpoint:
        runs = asyncio.run(run_target(prep, _openai_target(ctx.params, endpoint)))
    else:
        from kiln.bench.targets import InProcessTarget
        from kiln.runtime import LLM

        try:
            serving = ExecutorConfig(**given(ExecutorConfig, options, exclude=_EXECUTOR_EXCLUDE),
                                     metrics_window=1 << 20)
            llm = LLM(engine_dir, config=serving)
        except KilnError as exc:
            raise click.ClickException(str(exc)) from None
        try:
            runs = asyncio.run(run_target(prep, InProcessTarget(llm)))
        finally:
            llm.shutdown()
    result = finish_result(prep.config, runs, prep.slo, prep.facts, load_start, t0)
    _write_outputs(result, out_dir, plots=not no_plots)


@dataclass
class Prepared:
    """What every target of one ``kiln bench`` invocation runs: the workload, the rates, the prompts, the SLO."""

    work: object          # kiln.bench.workload.Workload
    plan: list[float] | str
    synth: object         # kiln.bench.workload.PromptSynthesizer
    slo: SLO
    facts: object | None  # EngineFacts of --engine
    config: dict
    params: dict


def prepare(params: dict, targets: int | None = None) -> Prepared:
    """The workload, rate plan, prompts and SLO from ``kiln bench``'s options (``targets``: how many of --engine /
    --endpoint / --dry-run were chosen; None: compare's targets stand in for them)."""
    try:
        import matplotlib  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(f"kiln bench needs its extras ({exc.name} is missing): "
                                   "pip install 'kiln-llm[bench]'") from None
    from kiln.bench import workload as wl
    from kiln.bench.engine_facts import FactsError, engine_facts

    p = params
    rate, rates, sweep, max_throughput = p["rate"], p["rates"], p["sweep"], p["max_throughput"]
    engine_dir, tokenizer, vocab_size, seed = p["engine_dir"], p["tokenizer"], p["vocab_size"], p["seed"]
    modes = sum(x is not None and x is not False for x in (rate, rates, sweep, max_throughput or None))
    if modes > 1:
        raise click.UsageError("choose one of --rate, --rates, --sweep auto, --max-throughput")
    if targets is not None and targets != 1:
        raise click.UsageError("choose one target: --engine DIR (in-process), --endpoint URL, or --dry-run")
    slo = SLO(_duration(p["slo_ttft_p95"]), _duration(p["slo_tpot_p95"]))
    facts = None
    if engine_dir is not None:
        try:
            facts = engine_facts(engine_dir)
        except FactsError as exc:
            raise click.ClickException(str(exc)) from None
    if p["dry_run"] and vocab_size is None and engine_dir is None and tokenizer is None:
        vocab_size = 32000

    # ---- workload
    trace, prompt_len, output_len = p["trace"], p["prompt_len"], p["output_len"]
    p_scale = p["prompt_scale"] if p["prompt_scale"] is not None else (p["length_scale"] or 1.0)
    o_scale = p["output_scale"] if p["output_scale"] is not None else (p["length_scale"] or 1.0)
    rows = None
    try:
        if trace is not None:
            rows = wl.read_trace(trace)
        if trace is not None and prompt_len is None and output_len is None:
            work = wl.trace_workload(rows, window=_window(p["window"]), max_requests=p["max_requests"],
                                     prompt_scale=p_scale, output_scale=o_scale, source=str(trace))
        else:
            n = p["max_requests"] or p["num_requests"]
            work = wl.synthetic_workload(n, rate=1.0, seed=seed, burstiness=p["burstiness"],
                                         prompt_len=wl.LengthSpec.parse(prompt_len or "128"),
                                         output_len=wl.LengthSpec.parse(output_len or "128"), trace_rows=rows)
            if p_scale != 1.0 or o_scale != 1.0:
                from dataclasses import replace

                work = wl.Workload([replace(r, prompt_len=max(1, round(r.prompt_len * p_scale)),
                                            output_len=max(1, round(r.output_len * o_scale))) for r in work.requests],
                                   dict(work.description, prompt_scale=p_scale, output_scale=o_scale))
    except (wl.TraceError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if p["shared_prefix"]:
        n_p, l_p = _pair(p["shared_prefix"], "--shared-prefix")
        work = wl.with_shared_prefix(work, n_p, l_p, seed)
    if p["clip_to_engine"]:
        if facts is None:
            raise click.UsageError("--clip-to-engine needs --engine DIR (with --endpoint: the served engine's "
                                   "directory)")
        work = wl.clip_to_bounds(work, facts.bounds.max_input_len, facts.bounds.max_seq_len)
        click.echo(wl.clip_summary(work.description["clip"]), err=True)
    work.description.update(seed=seed, totals=work.totals())

    if max_throughput:
        plan: list[float] | str = [math.inf]
    elif rates:
        plan = _rates(rates)
    elif sweep:
        plan = "auto"
    elif rate is not None:
        plan = [rate]
    else:  # replay at the pattern's own rate (a trace's recorded rate x --rate-scale)
        plan = [work.mean_rate * p["rate_scale"]]
    vocab, specials, vocab_source = _vocab_and_specials(engine_dir, tokenizer, vocab_size)
    synth = wl.PromptSynthesizer(vocab, seed, specials)
    p["out_dir"].mkdir(parents=True, exist_ok=True)
    config = {
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in p.items() if k != "api_key"},
        "workload": work.description, "slo": slo.as_dict(),
        "rates": plan if plan == "auto" else [("max" if math.isinf(r) else r) for r in plan],
        "prompts": {"vocab_size": vocab, "vocab_source": vocab_source, "special_ids_avoided": len(specials),
                    "seed": seed, "sent_as": "token ids"},
        "warmup_requests": p["warmup"],
    }
    return Prepared(work, plan, synth, slo, facts, config, p)


async def run_target(prep: Prepared, target, config: dict | None = None) -> list[dict]:
    """Warm ``target`` up, then run the sweep; ``config`` (default: ``prep.config``) gets the target's description."""
    from kiln.bench.runner import run_sweep

    config = prep.config if config is None else config
    p = prep.params
    try:
        if _is_openai(target):
            await target.resolve_model()
        config["target"] = target.describe()
        await _warm(target, p["warmup"], prep.synth)
        return await run_sweep(target, prep.work, prep.synth, prep.plan, slo=prep.slo, progress=not p["no_progress"],
                               timeout=p["run_timeout"], start_rate=p["start_rate"],
                               log=lambda m: click.echo(m, err=True))
    except ConnectionError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        await target.close()


def _openai_target(params: dict, endpoint: str, model: str | None = None):
    """An OpenAI target with ``kiln bench``'s client options (metrics, key, timeout, forced lengths)."""
    mu = None if params["metrics_url"] == "none" else (params["metrics_url"] or "auto")
    return _OpenAI(endpoint, model=model or params["model"], metrics_url=mu, api_key=params["api_key"],
                   request_timeout=params["request_timeout"], force_lengths=not params["no_force_lengths"])


class _OpenAI:  # lazily resolved alias so that `kiln bench --help` does not import httpx
    def __new__(cls, *args, **kwargs):
        from kiln.bench.targets import OpenAITarget

        return OpenAITarget(*args, **kwargs)


def _is_openai(target) -> bool:
    return getattr(target, "kind", None) == "openai"


async def _warm(target, n: int, synth) -> None:
    """Unmeasured requests: first calls of an engine (and first connections) are slower."""
    from kiln.bench.targets import RequestRecord

    for i in range(n):
        rec = RequestRecord(-1 - i, time.perf_counter(), 16, 4)
        await target.send(rec, synth.warmup_prompt(i, 16))
        if rec.outcome != "completed":
            raise click.ClickException(f"warm-up request failed ({rec.error_kind}: {rec.error}); is the target up "
                                       "and serving this model?")


def finish_result(config: dict, runs: list[dict], slo: SLO, facts, load_start: float, t0: float) -> dict:
    from kiln.bench.report import RESULT_FORMAT
    from kiln.bench.runner import calibration, environment, sweep_summary

    env = environment()
    return {
        "kiln_bench_result": RESULT_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)),
        "config": config, "versions": {k: env[k] for k in ("kiln", "torch", "python")},
        "machine": {"platform": env["platform"], "cpus": env["cpus"], "torch_threads": env["torch_threads"],
                    "loadavg_1m_start": load_start, "loadavg_1m_end": os.getloadavg()[0]},
        "engine": facts.as_dict() if facts is not None else None,
        "summary": sweep_summary(runs, slo), "calibration": calibration(runs, facts), "runs": runs,
    }


def _write_outputs(result: dict, out_dir: Path, plots: bool) -> None:
    from kiln.bench.report import format_result, write_result

    write_result(result, out_dir / "result.json")
    click.echo(format_result(result))
    click.echo(f"result: {out_dir / 'result.json'}")
    if plots:
        from kiln.bench.plots import write_plots

        for p in write_plots(result, out_dir):
            click.echo(f"plot: {p}")


@bench.command("compare")
@click.argument("results", nargs=-1, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--target", "targets", multiple=True, metavar="NAME=URL",
              help="An OpenAI-compatible server to run the workload against (repeat it; in order: ratios are to "
                   "the first).")
@click.option("--launch", "launches", multiple=True, metavar="NAME=COMMAND",
              help="Start target NAME with COMMAND (shell words) before its run and stop it after: measures its "
                   "startup time and idle RSS; one server runs at a time.")
@click.option("--pid", "pids", multiple=True, metavar="NAME=PID",
              help="The pid of a running target's server: its idle RSS (process tree) is read before the run.")
@click.option("--startup-timeout", type=float, default=600.0, show_default=True,
              help="Seconds a launched server may take until /v1/models answers.")
@click.pass_context
def compare_cmd(ctx, results: tuple[Path, ...], targets, launches, pids, startup_timeout) -> None:
    """Side by side: run the workload of `kiln bench`'s options against each --target (e.g. kiln and vLLM), or
    read two or more result.json files.

    \b
    kiln bench --trace code.csv --prompt-scale 0.25 --rates 2,3,4 --num-requests 32 --slo-ttft-p95 2s \\
      --slo-tpot-p95 200ms --output cmp/ compare --target kiln=http://127.0.0.1:8000 \\
      --target vllm=http://127.0.0.1:8001 --launch "vllm=python vllm_cli.py serve CKPT --port 8001"
    kiln bench compare a/result.json b/result.json
    """
    from kiln.bench.compare import CompareError, format_comparison, parse_targets, write_comparison_plot
    from kiln.bench.report import ResultError, read_result

    if results and (targets or launches or pids):
        raise click.UsageError("give result files or --target options, not both")
    if results:
        if len(results) < 2:
            raise click.UsageError("compare needs two or more result files")
        try:
            loaded = {}
            for i, path in enumerate(results):   # named by their target (or folder); the same twice: two columns
                r = read_result(path)
                name = (r["config"].get("target") or {}).get("name") or path.parent.name or str(path)
                loaded[name if name not in loaded else f"{name} #{i + 1}"] = r
        except ResultError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(format_comparison(loaded, {n: r.get("server_process", {}) for n, r in loaded.items()}))
        return
    try:
        specs = parse_targets(targets, launches, pids)
    except CompareError as exc:
        raise click.BadParameter(str(exc)) from None
    params = ctx.parent.params
    if params["endpoint"] or params["dry_run"]:
        raise click.UsageError("compare's servers are its --target options; leave --endpoint / --dry-run out")
    prep = prepare(params)
    out_dir = params["out_dir"]
    loaded, extras = {}, {}
    for spec in specs:
        try:
            loaded[spec.name], extras[spec.name] = _compare_one(prep, spec, out_dir / spec.name, startup_timeout)
        except CompareError as exc:
            raise click.ClickException(str(exc)) from None
    text = format_comparison(loaded, extras)
    (out_dir / "compare.txt").write_text(text + "\n")
    import json

    (out_dir / "compare.json").write_text(json.dumps({"targets": [s.name for s in specs], "extras": extras}, indent=1))
    click.echo(text)
    if not params["no_plots"]:
        click.echo(f"plot: {write_comparison_plot(loaded, out_dir / 'compare.png')}")


def _compare_one(prep: Prepared, spec, out_dir: Path, startup_timeout: float) -> tuple[dict, dict]:
    """One target of a comparison: launch it (if asked), read its idle RSS, run the sweep, stop it; its result
    (also written to OUT/NAME/result.json) and the startup / RSS facts."""
    import copy

    from kiln.bench.compare import launch, stop, tree_rss_bytes

    extras: dict = {"startup_s": None, "idle_rss_bytes": None}
    proc, pid = None, spec.pid
    if spec.command:
        click.echo(f"[{spec.name}] launching: {' '.join(spec.command)}", err=True)
        proc, extras["startup_s"] = launch(spec, startup_timeout, out_dir / "server.log")
        pid = proc.pid
        click.echo(f"[{spec.name}] up after {extras['startup_s']:.1f} s", err=True)
    try:
        if pid is not None:
            extras["idle_rss_bytes"] = tree_rss_bytes(pid)
        config = copy.deepcopy(prep.config)
        load_start, t0 = os.getloadavg()[0], time.time()
        runs = asyncio.run(run_target(prep, _openai_target(prep.params, spec.url), config))
    finally:
        if proc is not None:
            stop(proc)
    config["target"]["name"] = spec.name
    result = finish_result(config, runs, prep.slo, prep.facts, load_start, t0)
    result["server_process"] = extras
    _write_outputs(result, out_dir, plots=not prep.params["no_plots"])
    return result, extras
