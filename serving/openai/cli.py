"""``kiln serve --frontend openai MODEL_DIR``: the OpenAI-compatible HTTP server's command line.

MODEL_DIR is an engine directory, or a Hugging Face checkpoint directory whose engine is built on first use
into kiln's engine cache with the build flags given after it (``kiln.build_flags``) and loaded from there.
"""

from __future__ import annotations

from pathlib import Path

import click

from kiln.build_flags import build_config_from, build_options
from kiln.clikit import dataclass_options, given
from kiln.contract import ConfigError
from kiln.runtime import ExecutorConfig
from kiln.runtime.disagg.config import DisaggConfig
from kiln.serving.openai.tool_parsers import TOOL_CALL_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on; 0 picks a free one (the URL printed at startup says which).")
@click.option("--served-model-name", default=None,
              help="The model id clients send; default: MODEL_DIR's name.")
@click.option("--api-key", envvar="KILN_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on /v1 endpoints.")
@click.option("--max-waiting", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests waiting for their first token beyond which new ones get 429 with Retry-After.")
@click.option("--chat-template", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="A jinja2 chat template file (as for transformers' apply_chat_template); default: the one "
                   "in the engine directory's tokenizer_config.json.")
@click.option("--tool-call-parser", type=click.Choice(TOOL_CALL_PARSERS), default=None,
              help="How tool_choice 'auto' finds tool calls in answers: hermes (<tool_call> JSON: Hermes, Qwen) or "
                   "llama3_json (Llama 3.1+ JSON calls); default: the one the chat template's format needs.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM/SIGINT, seconds to let in-flight requests finish before aborting them.")
@click.option("--batch-store", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Serve the Batch API (/v1/files, /v1/batches) with its state in DIR/batches.sqlite3; a "
                   "restarted server resumes the unfinished batches of the same DIR.")
@click.option("--batch-window", type=click.IntRange(min=1), default=None,
              help="Batch lines in the engine at once (at the lowest priority); default: --max-batch-size.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
@click.option("--timeout-keep-alive", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds an idle kept-alive connection stays open.")
@click.option("--timeout-request-headers", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Seconds a request's headers may take to arrive (from its first byte, or "
                                      "from the connection); then 408 and the connection is closed.")
@click.option("--timeout-request-body", type=click.FloatRange(min=0, min_open=True), default=30.0,
              show_default=True, help="Seconds a request's body may take to arrive after its headers; then 408 "
                                      "and the connection is closed.")
@click.option("--max-connections", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Open connections (or requests in flight) beyond which new requests get 503; keep it below "
                   "the process's open-file limit (ulimit -n).")
@click.option("--metrics-require-key", is_flag=True,
              help="Require the --api-key on /metrics too (by default /metrics is open, as vLLM's is).")
@click.option("--prompt-workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Threads that parse, render and tokenize large prompts off the event loop.")
@click.option("--lora-modules", multiple=True, metavar="NAME=PATH",
              help="A PEFT LoRA adapter to serve as model NAME (repeat the flag for more); the engine "
                   "must be built with --lora-target-modules.")
@click.option("--enable-lora-runtime-loading", is_flag=True, default=False,
              help="Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies).")
@dataclass_options(DisaggConfig)
@dataclass_options(ExecutorConfig)
@build_options
def serve(model_dir: Path, **options) -> None:
    """Serve MODEL_DIR with an OpenAI-compatible HTTP API, one LLM per server. MODEL_DIR is an engine directory
    (written by build-engine) or a Hugging Face checkpoint directory, built on first use into the engine cache
    ($KILN_CACHE_DIR, default ~/.cache/kiln/engines) with the [checkpoint build] flags given after it, and
    loaded from the cache the next time.

    Runtime options (--max-batch-size ... --seed) are kiln.runtime.ExecutorConfig's fields (--max-batch-size
    and --max-num-tokens also set a checkpoint's engine bounds). Other frontends: kiln serve --frontend NAME
    --help.
    """
    from kiln.serving.openai.server import ServeSettings, run

    if options["metrics_require_key"] and options["api_key"] is None:
        raise click.UsageError("--metrics-require-key needs --api-key (or KILN_API_KEY)")
    build = build_config_from(options)
    runtime = given(ExecutorConfig, options)   # what the user gave; ExecutorConfig applies its defaults
    try:
        disagg = DisaggConfig(**given(DisaggConfig, options))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    raise SystemExit(run(model_dir, ServeSettings(**options, disagg=disagg), runtime, build))
