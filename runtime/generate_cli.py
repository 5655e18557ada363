"""``kiln generate``: run prompts through an engine with in-flight batching and print outputs and metrics.

Its sampling and serving options are the fields of ``SamplingParams`` and ``ExecutorConfig`` (see
``kiln.clikit``): the same names, defaults and checks as the Python API.
"""

from __future__ import annotations

import json
import queue
import sys
from pathlib import Path

import click

from kiln.clikit import dataclass_options, given
from kiln.runtime.executor import ExecutorConfig
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams

# ExecutorConfig.seed (the default generator's) would clash with the per-request --seed of SamplingParams
_EXECUTOR_EXCLUDE = ("seed", "metrics_window")
# a structured field: --structured-output takes it as JSON
_SAMPLING_EXCLUDE = ("structured_output",)


def structured_output_option(value: str | None) -> dict | None:
    """--structured-output: a JSON object of StructuredOutputParams fields, or @FILE holding one."""
    if value is None:
        return None
    text = value
    if value.startswith("@"):
        try:
            text = Path(value[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise click.BadParameter(f"cannot read {value[1:]}: {exc.strerror}",
                                     param_hint="--structured-output") from None
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc})", param_hint="--structured-output") from None
    if not isinstance(spec, dict):
        raise click.BadParameter('give a JSON object such as \'{"regex": "[0-9]+"}\' or '
                                 '\'{"json": {"type": "object"}}\'', param_hint="--structured-output")
    return spec


def summary_line(out: RequestOutput) -> str:
    m = out.metrics
    tpot = f"{m.mean_tpot * 1e3:.1f} ms" if m.mean_tpot is not None else "-"
    return (f"    [{len(out.token_ids)} tokens, {out.finish_reason}; queue {m.queue_time * 1e3:.1f} ms, "
            f"TTFT {m.ttft * 1e3:.1f} ms, TPOT {tpot}]")


def stream_all(llm, prompts: list[str], params: SamplingParams) -> None:
    """Submit every prompt at once (they are batched), then print each one's text as it arrives, one prompt
    after the other: the same layout as without --stream. Any exception (Ctrl-C) aborts them all."""
    queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in prompts]
    ids = []
    try:
        for prompt, q in zip(prompts, queues):
            ids.append(llm.submit(prompt, params, callback=q.put))
        for prompt, q in zip(prompts, queues):
            click.echo(f"--- {prompt!r}")
            while True:
                out = q.get()
                click.echo(out.delta_text, nl=False)
                sys.stdout.flush()
                if out.finished:
                    break
            click.echo()
            if out.error:
                raise click.ClickException(out.error)
            click.echo(summary_line(out))
    except BaseException:
        for rid in ids:
            llm.abort(rid)
        raise


@click.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="Engine directory written by build-engine.")
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeat for several, run concurrently).")
@click.option("--prompt-file", type=click.File("r"), help="One prompt per line ('-' for stdin).")
@dataclass_options(SamplingParams, exclude=_SAMPLING_EXCLUDE)
@click.option("--structured-output", "structured_output_json", default=None, metavar="JSON|@FILE",
              help="Constrain every output: a JSON object with one of json (a JSON schema), json_object, regex, "
                   "choice, grammar (EBNF) or structural_tag, e.g. '{\"regex\": \"[0-9]{3}\"}'; @FILE reads it "
                   "from a file.")
@dataclass_options(ExecutorConfig, exclude=_EXECUTOR_EXCLUDE)
@click.option("--stream", is_flag=True, help="Print text as it is generated: every prompt runs at once; each one's "
                                            "text is printed under its header in turn.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per output.")
@click.option("--quiet-metrics", is_flag=True, help="Do not print the metrics summary.")
def generate(engine_dir: Path, prompts: tuple[str, ...], prompt_file, structured_output_json: str | None,
             stream: bool, as_json: bool, quiet_metrics: bool, **options) -> None:
    """Generate for PROMPTs concurrently (in-flight batching over a paged KV cache)."""
    from kiln.contract import KilnError
    from kiln.runtime import LLM

    prompts = list(prompts)
    if prompt_file is not None:
        prompts += [line.rstrip("\n") for line in prompt_file if line.strip()]
    if not prompts:
        raise click.UsageError("give at least one --prompt or a --prompt-file")
    try:
        params = SamplingParams(**given(SamplingParams, options, exclude=_SAMPLING_EXCLUDE),
                                structured_output=structured_output_option(structured_output_json))
        config = ExecutorConfig(**given(ExecutorConfig, options, exclude=_EXECUTOR_EXCLUDE))
        llm = LLM(engine_dir, config=config)
    except KilnError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        if stream and not as_json:
            stream_all(llm, prompts, params)
        else:
            for out in llm.generate(prompts, params):
                if as_json:
                    click.echo(json.dumps({"request_id": out.request_id, "prompt": out.prompt, "text": out.text,
                                           "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                                           "metrics": out.metrics.as_dict()}))
                else:
                    click.echo(f"--- {out.prompt!r}")
                    click.echo(out.text)
                    click.echo(summary_line(out))
        if not quiet_metrics and not as_json:
            click.echo("--- metrics")
            click.echo(llm.metrics_summary())
    except KilnError as exc:  # InvalidRequestError included: say why the request cannot run
        raise click.ClickException(str(exc)) from None
    finally:
        llm.shutdown()
