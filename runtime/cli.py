"""``kiln``: the command-line entry point, and the runtime's ``kiln inspect``.

Each package owns its subcommands and declares them in the ``kiln.commands`` entry-point group of
pyproject.toml (see that group for the installed set); the group below resolves them by name when they
are invoked, so the runtime never imports the packages that add commands, and ``kiln --help`` does not
import every package.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import click

from kiln.contract import EngineLoadError, format_table, io_spec, read_build_report, summary_rows

COMMANDS_GROUP = "kiln.commands"


class EntryPointGroup(click.Group):
    """A click group whose subcommands are the installed ``kiln.commands`` entry points, loaded lazily."""

    def _entry_points(self) -> dict[str, metadata.EntryPoint]:
        return {ep.name: ep for ep in metadata.entry_points(group=COMMANDS_GROUP)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._entry_points()))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None and (ep := self._entry_points().get(name)) is not None:
            command = ep.load()
        return command


@click.group(cls=EntryPointGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """kiln: run compiled LLM engines."""


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print config.json instead of the table.")
@click.option("--io", "show_io", is_flag=True, help="Also print the engine's inputs and output (the I/O contract "
                                                    "with this engine's dims and their ranges).")
@click.option("--load", is_flag=True, help="Also load the engine (every rank's file), run its largest step and report "
                                           "the process's peak resident memory against weights + KV pool + activations "
                                           "(rank 0's).")
def inspect(engine_dir: Path, as_json: bool, show_io: bool, load: bool) -> None:
    """Describe an engine directory: limits, weights, activation peak, KV bytes per token."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.memory import largest_step_check

    try:
        config = Engine.read_config(engine_dir)
        memory = largest_step_check(engine_dir) if load else None
    except EngineLoadError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        data = config.to_dict()
        if memory is not None:
            from kiln.plugins import native
            from kiln.runtime.kernels import linear_kernels

            data["loaded_memory"] = memory.to_dict()
            data["kernel_tuning"] = native.kernel_tuning()
            data["kernels"] = linear_kernels(engine_dir, _kernel_rows(config))
            data["context_attention"] = _context_attention(config)
        click.echo(json.dumps(data, indent=2))
        return
    report = read_build_report(engine_dir)
    click.echo(format_table(summary_rows(config, report)))
    if memory is not None:
        click.echo("loaded, largest step: " + memory.summary())
        _print_kernels(engine_dir, config)
        click.echo(f"context attention: {_context_attention(config)}")
    if report and report.get("passes"):
        def stats(v) -> str:
            return "off" if v == "disabled" else ", ".join(f"{a}={b}" for a, b in v.items()
                                                           if not isinstance(b, (dict, list)))

        click.echo("passes: " + ", ".join(f"{k} ({stats(v)})" for k, v in report["passes"].items()))
    if show_io:
        spec = io_spec(config)
        dims = spec["dims"]
        for kind in ("inputs", "outputs"):
            for t in spec[kind]:
                shape = ", ".join(f"{d} {dims[d]}" if d in dims else str(d) for d in t["shape"])
                click.echo(f"{kind[:-1]:<6} {t['name']:<15} {t['dtype']:<8} [{shape}]")


def _kernel_rows(config) -> dict[str, int]:
    b = config.bounds
    return {"decode": 1, f"batch {b.max_batch_size}": b.max_batch_size, f"prefill {b.max_num_tokens}": b.max_num_tokens}


def _context_attention(config) -> str:
    from kiln.plugins import attention

    m = config.model
    return attention.describe(config.dtype, m.head_dim, m.attn_logit_softcapping)


def _print_kernels(engine_dir: Path, config) -> None:
    """The native kernel and tuning of each linear at decode, a full batch and the largest prefill step."""
    from kiln.plugins import native
    from kiln.runtime.kernels import linear_kernels

    found = linear_kernels(engine_dir, _kernel_rows(config))
    if not found:
        return
    click.echo(f"kernels (ISA {native.panel_isa()}, tuning {native.kernel_tuning()}):")
    for lin in found:
        n, k = lin["shape"]
        click.echo(f"  {lin['name']} [{n}x{k}] {lin['kind']}")
        for label, desc in lin["kernels"].items():
            click.echo(f"      {label}: {desc}")


if __name__ == "__main__":
    main()
