"""``kiln generate``: run prompts through an engine with in-flight batching and print outputs and metrics."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import click


@click.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="Engine directory written by build-engine.")
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeat for several, run concurrently).")
@click.option("--prompt-file", type=click.File("r"), help="One prompt per line ('-' for stdin).")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--min-tokens", type=int, default=0, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Per-request seed (reproducible sampling).")
@click.option("--stop", multiple=True, help="Stop string (repeatable); trimmed from the output.")
@click.option("--ignore-eos", is_flag=True)
@click.option("--max-batch-size", type=int, default=None, help="Default: the engine's.")
@click.option("--max-num-tokens", type=int, default=None, help="Tokens per step; default: the engine's.")
@click.option("--kv-cache-memory-fraction", type=float, default=0.9, show_default=True)
@click.option("--max-kv-cache-tokens", type=int, default=None)
@click.option("--capacity-policy", type=click.Choice(["guaranteed_no_evict", "max_utilization"]),
              default="guaranteed_no_evict", show_default=True)
@click.option("--no-prefix-reuse", is_flag=True, help="Disable KV prefix reuse.")
@click.option("--stream", is_flag=True, help="Print text as it is generated (one prompt).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per output.")
@click.option("--quiet-metrics", is_flag=True, help="Do not print the metrics summary.")
def generate(engine_dir, prompts, prompt_file, max_tokens, min_tokens, temperature, top_k, top_p, min_p,
             repetition_penalty, seed, stop, ignore_eos, max_batch_size, max_num_tokens, kv_cache_memory_fraction,
             max_kv_cache_tokens, capacity_policy, no_prefix_reuse, stream, as_json, quiet_metrics):
    """Generate for PROMPTs concurrently (in-flight batching over a paged KV cache)."""
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.engine import EngineLoadError

    prompts = list(prompts)
    if prompt_file is not None:
        prompts += [line.rstrip("\n") for line in prompt_file if line.strip()]
    if not prompts:
        raise click.UsageError("give at least one --prompt or a --prompt-file")
    try:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, seed=seed,
                                stop=list(stop), ignore_eos=ignore_eos)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    try:
        llm = LLM(engine_dir, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                  kv_cache_memory_fraction=kv_cache_memory_fraction, max_kv_cache_tokens=max_kv_cache_tokens,
                  capacity_policy=capacity_policy, enable_prefix_reuse=not no_prefix_reuse)
    except (EngineLoadError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        if stream and len(prompts) == 1 and not as_json:
            async def run():
                last = None
                async for out in llm.generate_async(prompts[0], params):
                    sys.stdout.write(out.delta_text)
                    sys.stdout.flush()
                    last = out
                return [last]

            outs = asyncio.run(run())
            click.echo()
        else:
            outs = llm.generate(prompts, params)
        for out in outs:
            m = out.metrics
            if as_json:
                click.echo(json.dumps({"request_id": out.request_id, "prompt": out.prompt, "text": out.text,
                                       "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                                       "metrics": m.as_dict()}))
            elif not stream:
                click.echo(f"--- {out.prompt!r}")
                click.echo(f"{out.text}")
                tpot = f"{m.mean_tpot * 1e3:.1f} ms" if m.mean_tpot is not None else "-"
                click.echo(f"    [{len(out.token_ids)} tokens, {out.finish_reason}; queue {m.queue_time * 1e3:.1f} ms, "
                           f"TTFT {m.ttft * 1e3:.1f} ms, TPOT {tpot}]")
        if not quiet_metrics and not as_json:
            click.echo("--- metrics")
            click.echo(llm.metrics_summary())
    except ValueError as exc:  # InvalidRequestError included: say why the request cannot run
        raise click.ClickException(str(exc)) from None
    finally:
        llm.shutdown()
