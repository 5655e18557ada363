"""``kiln run-batch -i in.jsonl -o out.jsonl --model MODEL_DIR``: answer an OpenAI batch input file offline.

Every line goes through the HTTP endpoints' own handlers (``dispatch``), so an output body is what
``kiln serve`` would have answered. Output lines are appended as answers arrive (in any order, one per
input line); a rerun with the same output file skips the lines already answered, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import click

from kiln.build_flags import build_config_from, build_options
from kiln.clikit import dataclass_options, given
from kiln.runtime import ExecutorConfig
from kiln.serving.openai.tool_parsers import TOOL_CALL_PARSERS


def answered_keys(out: Path) -> set[str]:
    """What ``out`` already answers: valid lines by custom_id, line errors by line number. A last line cut off
    by an interrupted run is removed (its line runs again)."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    keep = data if data.endswith(b"\n") or not data else data[:data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        with open(out, "r+b") as f:
            f.truncate(len(keep))
    keys = set()
    for n, raw in enumerate(keep.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            keys.add(line_key(record))
        except (ValueError, KeyError, TypeError):
            raise click.ClickException(f"{out}: line {n} is not a batch output line; give a new output file or "
                                       "the one an earlier run of this input wrote") from None
    return keys


def line_key(record: dict) -> str:
    error = record.get("error")
    if error is not None and "line" in error:
        return f"line:{error['line']}"
    return f"id:{record['custom_id']}"


async def run_file(llm, input_path: Path, output: Path, *, window: int, model_name: str | None, chat_template,
                   tool_call_parser: str | None, progress: bool = True) -> tuple[int, int]:
    """Answer every line of ``input_path`` not yet in ``output``; (lines answered now, lines skipped)."""
    from kiln.serving.batch.dispatch import Dispatcher
    from kiln.serving.batch.feeder import Feeder
    from kiln.serving.batch.lines import BatchLine, error_line, parse_lines, response_line
    from kiln.serving.openai.app import engine_fingerprint
    from kiln.serving.openai.generation import ServingState

    items = parse_lines(input_path.read_bytes())
    done = answered_keys(output)
    todo = [it for it in items if (f"id:{it.custom_id}" if isinstance(it, BatchLine) else f"line:{it.line_no}")
            not in done]
    state = ServingState(llm, max_waiting=window)
    dispatcher = Dispatcher(state, model_name=model_name, fingerprint=engine_fingerprint(llm),
                            chat_template=chat_template, tool_call_parser=tool_call_parser)
    feeder = Feeder(dispatcher, window)
    written = [0]
    with open(output, "a", encoding="utf-8") as f, \
            click.progressbar(length=len(todo), label="run-batch", file=sys.stderr, show_pos=True,
                              hidden=not progress) as bar:
        def write(record: dict) -> None:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            written[0] += 1
            bar.update(1)

        for it in todo:
            if not isinstance(it, BatchLine):
                write(error_line(it))
        try:
            await feeder.run([it for it in todo if isinstance(it, BatchLine)],
                             lambda line, status, body: write(response_line(line.custom_id, status, body)))
        finally:
            state.workers.shutdown()
        os.fsync(f.fileno())
    return written[0], len(items) - len(todo)


@click.command("run-batch", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-i", "--input", "input_path", required=True, type=click.Path(path_type=Path, exists=True,
              dir_okay=False), help="OpenAI batch input file (JSONL: custom_id, method, url, body).")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path, dir_okay=False),
              help="Output file (JSONL: id, custom_id, response, error), appended; a rerun skips what it answers.")
@click.option("--model", "--engine", "model_dir", required=True,
              type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="An engine directory, or a Hugging Face checkpoint directory (built on first use into the "
                   "engine cache with the build flags).")
@click.option("--served-model-name", default=None,
              help="Refuse (404) lines whose body names another model; default: any model name is answered.")
@click.option("--chat-template", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="A jinja2 chat template file; default: the one in the engine directory's tokenizer_config.json.")
@click.option("--tool-call-parser", type=click.Choice(TOOL_CALL_PARSERS), default=None,
              help="How tool_choice 'auto' finds tool calls; default: the one the chat template's format needs.")
@click.option("--window", type=click.IntRange(min=1), default=None,
              help="Lines in the engine at once; default: twice max_batch_size.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="A progress bar on stderr.")
@dataclass_options(ExecutorConfig)
@build_options
def run_batch(input_path: Path, output: Path, model_dir: Path, served_model_name: str | None,
              chat_template: Path | None, tool_call_parser: str | None, window: int | None, progress: bool,
              **options) -> None:
    """Answer an OpenAI batch input file (url /v1/completions or /v1/chat/completions) with the handlers of
    kiln serve, writing one output line per input line, in any order. Lines that cannot be sent (not JSON, no
    custom_id, unknown url, duplicate custom_id) get an output line with "error"; requests an endpoint
    refuses get their status code and OpenAI error body in "response"."""
    from kiln.build_flags import resolve
    from kiln.runtime import LLM, ConfigError, EngineLoadError
    from kiln.serving.chat_template import ChatTemplateError, load_chat_template
    from kiln.serving.openai.tool_parsers import detect_parser

    build = build_config_from(options)
    try:
        # no online traffic shares this engine: batch work may take every step's whole budget
        config = ExecutorConfig(**{"batch_max_share": 1.0, **given(ExecutorConfig, options)})
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    engine_dir = resolve(model_dir, *build)
    try:
        template = load_chat_template(engine_dir, chat_template)
    except ChatTemplateError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        llm = LLM(engine_dir, config=config)
    except (EngineLoadError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        parser = tool_call_parser or detect_parser(template.source if template is not None else None)
        window = window or 2 * int(llm.stats()["config"]["max_batch_size"])
        written, skipped = asyncio.run(run_file(llm, input_path, output, window=window, model_name=served_model_name,
                                                chat_template=template, tool_call_parser=parser, progress=progress))
    finally:
        llm.shutdown()
    click.echo(f"kiln run-batch: {written} lines answered into {output}"
               + (f" ({skipped} answered by an earlier run)" if skipped else ""), err=True)
