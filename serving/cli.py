"""``kiln serve ENGINE_DIR``: serve an engine over the network.

Frontends: ``openai`` (default) is the OpenAI-compatible HTTP server (serving/openai/). A frontend is a
module with ``run(engine_dir, settings, executor_options) -> exit code``, registered in FRONTENDS by
import path and imported only when chosen; adding one is one entry here plus its module.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from kiln.serving.executor_options import executor_options, split_executor_options
from kiln.serving.settings import ServeSettings

FRONTENDS = {"openai": "kiln.serving.openai.server"}
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--frontend", type=click.Choice(sorted(FRONTENDS)), default="openai", show_default=True,
              help="Which server to run.")
@click.option("--host", default=ServeSettings.host, show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=ServeSettings.port, show_default=True,
              help="Port to listen on; 0 picks a free one (the URL printed at startup says which).")
@click.option("--served-model-name", default=None, help="The model id clients send; default: the engine directory's name.")
@click.option("--api-key", envvar="KILN_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on /v1 endpoints.")
@click.option("--max-waiting", type=click.IntRange(min=1), default=ServeSettings.max_waiting, show_default=True,
              help="Requests waiting for their first token beyond which new ones get 429 with Retry-After.")
@click.option("--chat-template", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="A jinja2 chat template file (as for transformers' apply_chat_template); default: the one "
                   "in the engine directory's tokenizer_config.json.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=ServeSettings.shutdown_timeout,
              show_default=True, help="On SIGTERM/SIGINT, seconds to let in-flight requests finish before aborting them.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default=ServeSettings.log_level, show_default=True)
@executor_options
def serve(engine_dir: Path, frontend: str, **options) -> None:
    """Serve ENGINE_DIR (written by build-engine) over HTTP, one LLM per server."""
    runtime, rest = split_executor_options(options)
    settings = ServeSettings(**rest)
    module = importlib.import_module(FRONTENDS[frontend])
    sys.exit(module.run(engine_dir, settings, runtime))
