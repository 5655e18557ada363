"""``build-engine``: checkpoint directory -> engine directory, with per-stage progress and a summary."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from kiln.builder.build import build_engine, stages
from kiln.builder.config import BuildConfig
from kiln.clikit import dataclass_options, given
from kiln.contract import KilnError, format_table, read_build_report, read_engine_config, summary_rows


def _list_passes(ctx: click.Context, _param, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from kiln.builder.passes import PASSES

    for p in PASSES:
        click.echo(f"{p.NAME:<18} {p.DESCRIPTION}")
    ctx.exit(0)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--checkpoint", type=click.Path(path_type=Path), help="Hugging Face checkpoint directory.")
@click.option("--output", type=click.Path(path_type=Path), help="Engine directory to write (replaced if it exists).")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="BuildConfig YAML (flags override it).")
@dataclass_options(BuildConfig, exclude=("disabled_passes",))
@click.option("--disable-pass", "disabled", multiple=True, metavar="NAME",
              help="Skip a pass (repeatable; added to the YAML's disabled_passes).")
@click.option("--passes", is_flag=True, expose_value=False, is_eager=True, callback=_list_passes,
              help="List the passes and exit.")
def build_engine_cmd(checkpoint, output, config_path, disabled, **flags) -> None:
    """Build a kiln engine from a Hugging Face checkpoint."""
    if checkpoint is None or output is None:
        raise click.UsageError("--checkpoint and --output are required")
    from kiln.builder.passes import check_names

    try:
        check_names(list(disabled))
        base = BuildConfig.from_yaml(config_path) if config_path else BuildConfig()
        changes = given(BuildConfig, flags)
        if disabled:
            changes["disabled_passes"] = sorted(set(base.disabled_passes) | set(disabled))
        build = base.replace(**changes) if changes else base
    except KilnError as exc:
        raise click.ClickException(str(exc)) from None

    started: dict[str, float] = {}
    runs = stages(build)

    def progress(stage: str, message: str) -> None:
        n = runs.index(stage) + 1 if stage in runs else 0
        if message.startswith("start"):
            started[stage] = time.perf_counter()
            rank = message.removeprefix("start").strip()   # "rank r/N" of a tensor-parallel build
            click.echo(f"[{n}/{len(runs)}] {stage:<12}{' ' + rank if rank else ''} ...", nl=False)
        else:
            click.echo(f" {message}")

    tp = f", {build.tp_size} tensor-parallel ranks" if build.tp_size > 1 else ""
    click.echo(f"building {checkpoint} -> {output} ({build.backend}, {build.dtype}, quantization {build.quantization}"
               f"{tp})")
    try:
        out = build_engine(checkpoint, output, build, progress=progress)
    except (KilnError, OSError) as exc:   # OSError: the disk filled up, a file vanished during the build
        if started:
            click.echo("")
        raise click.ClickException(str(exc)) from None
    click.echo(format_table(summary_rows(read_engine_config(out), read_build_report(out))))
    click.echo(f"engine written to {out}")


def build_engine_main(argv: list[str] | None = None) -> None:
    build_engine_cmd.main(args=argv, prog_name="build-engine")


if __name__ == "__main__":
    sys.exit(build_engine_main())
