"""``kiln``: the command-line entry point.

Each package owns its subcommands (runtime: ``generate``, ``inspect``; serving: ``serve``, ...) and
declares them in the ``kiln.commands`` entry-point group of pyproject.toml; the group below resolves
them by name when they are invoked, so the runtime never imports serving or bench, and ``kiln --help``
does not import every package.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import click

from kiln.runtime.engine import Engine, EngineLoadError


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def engine_summary(config: dict, report: dict | None) -> list[tuple[str, str]]:
    """The rows ``build-engine`` prints at the end of a build, from an engine directory's files."""
    mem = config.get("memory", {})
    b, m = config["build"], config["model"]
    rows = [
        ("model", f"{m['architecture']} ({m['num_layers']} layers, hidden {m['hidden_size']}, vocab {m['vocab_size']})"),
        ("backend / dtype", f"{config['backend']} / {b['dtype']} (kv {b['kv_cache_dtype']}, quantization {b['quantization']})"),
        ("limits", f"batch {b['max_batch_size']}, tokens/step {b['max_num_tokens']}, seq {b['max_seq_len']}, "
                   f"block {b['tokens_per_block']}"),
        ("weights", _human_bytes(mem.get("weights_bytes", 0))),
        ("activation peak", f"{_human_bytes(mem.get('activation_peak_bytes', 0))} "
                            f"(no reuse: {_human_bytes(mem.get('activation_naive_bytes', 0))})"),
        ("KV bytes/token", f"{mem.get('kv_bytes_per_token', 0)} B"),
        ("KV tokens in 1 GiB", f"{mem.get('kv_tokens_per_gib', 0):,}"),
    ]
    if report:
        rows.append(("GEMMs before/after passes", f"{report['gemms']['before_passes']} -> {report['gemms']['after_passes']}"))
        rows.append(("build time", f"{report['timings_s'].get('total', 0):.1f} s"))
    rows.append(("format / kiln / torch", f"{config['format_version']} / {config.get('kiln_version', '?')} / {config['torch_version']}"))
    rows.append(("eos / bos token ids", f"{config.get('eos_token_ids')} / {config.get('bos_token_id')}"))
    return rows


def _print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 3 + max(len(v) for _, v in rows))
    click.echo(line)
    for k, v in rows:
        click.echo(f"{k:<{width}} | {v}")
    click.echo(line)


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
@click.option("--load", is_flag=True, help="Also load the engine graph (checks rank0.engine).")
def inspect(engine_dir: Path, as_json: bool, load: bool) -> None:
    """Describe an engine directory: limits, weights, activation peak, KV bytes per token."""
    try:
        config = Engine.from_dir(engine_dir).config if load else Engine.read_config(engine_dir)
    except EngineLoadError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(config, indent=2))
        return
    report_path = engine_dir / "build_report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    _print_table(engine_summary(config, report))
    if report and report.get("passes"):
        click.echo("passes: " + ", ".join(
            f"{k} ({'off' if v == 'disabled' else ', '.join(f'{a}={b}' for a, b in v.items() if not isinstance(b, (dict, list)))})"
            for k, v in report["passes"].items()))


if __name__ == "__main__":
    main()
