"""``kiln serve [--frontend NAME] ENGINE_DIR ...``: serve an engine over the network.

Each frontend is its own click command, named in FRONTENDS by import path and imported only when chosen;
``kiln serve`` takes ``--frontend`` (default ``openai``) and hands every other argument, ``--help``
included, to that command. Adding a frontend is one entry here plus its command.
"""

from __future__ import annotations

import importlib

import click

FRONTENDS = {"openai": "kiln.serving.openai.cli:serve", "triton": "kiln.serving.triton.cli:serve"}


def frontend_command(name: str) -> click.Command:
    module, _, attr = FRONTENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


@click.command(context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.option("--frontend", type=click.Choice(sorted(FRONTENDS)), default="openai",
              help="Which server: openai (the OpenAI-compatible HTTP API) or triton (NVIDIA Triton Inference "
                   "Server on a model repository rendered for the engine; the kiln-llm[triton] extra).")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def serve(ctx: click.Context, frontend: str, args: tuple[str, ...]) -> None:
    """Serve an engine over the network (--frontend openai: the OpenAI-compatible HTTP API; --frontend triton:
    NVIDIA Triton Inference Server). `kiln serve --frontend NAME --help` lists that frontend's options."""
    frontend_command(frontend).main(args=list(args), prog_name=f"{ctx.command_path} --frontend {frontend}")
