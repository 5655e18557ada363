"""Command-line options made from config dataclasses: one definition of names, defaults, help and checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import click
import pytest
from click.testing import CliRunner

from kiln.clikit import dataclass_options, given
from kiln.runtime import ExecutorConfig, SamplingParams


@dataclass
class Knobs:
    size: int = field(default=3, metadata={"help": "How many."})
    ratio: float | None = field(default=None, metadata={"help": "A share."})
    mode: str = field(default="a", metadata={"help": "Which.", "choices": ("a", "b")})
    on: bool = field(default=True, metadata={"help": "Whether."})
    tags: list[str] = field(default_factory=list, metadata={"help": "Tags."})

    def __post_init__(self):
        if self.mode not in ("a", "b"):
            raise ValueError(f"mode must be a or b, got {self.mode!r}")


@click.command()
@dataclass_options(Knobs)
def show(**kw):
    click.echo(repr(Knobs(**given(Knobs, kw))))


def test_options_follow_the_dataclass():
    r = CliRunner().invoke(show, [])
    assert r.output.strip() == repr(Knobs())          # nothing given: the dataclass's own defaults
    r = CliRunner().invoke(show, ["--size", "5", "--ratio", "0.5", "--mode", "b", "--no-on", "--tags", "x",
                                  "--tags", "y"])
    assert r.output.strip() == repr(Knobs(size=5, ratio=0.5, mode="b", on=False, tags=["x", "y"]))
    help_text = CliRunner().invoke(show, ["--help"]).output
    assert "How many.  [default: 3]" in help_text and "--mode [a|b]" in help_text and "--on / --no-on" in help_text
    r = CliRunner().invoke(show, ["--mode", "c"])       # checked by the dataclass, not by click
    assert isinstance(r.exception, ValueError) and "mode must be a or b" in str(r.exception)


@pytest.mark.parametrize("cls, exclude", [(SamplingParams, ("structured_output",)),   # --structured-output JSON
                                          (ExecutorConfig, ("seed", "metrics_window"))])
def test_generate_has_an_option_per_field_with_the_api_default(cls, exclude):
    from kiln.runtime.generate_cli import generate

    options = {p.name: p for p in generate.params}
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        assert f.name in options, f.name
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if default not in (None, []) and not isinstance(default, bool):
            assert f"[default: {default}]" in options[f.name].help
    assert given(SamplingParams, {"temperature": None, "stop": (), "top_k": 5}) == {"top_k": 5}


@pytest.mark.parametrize("args, message", [
    (["--top-p", "0"], "invalid SamplingParams: top_p must be a finite number in (0, 1]"),
    (["--capacity-policy", "fifo"], "capacity_policy must be one of"),
    (["--max-batch-size", "0"], "max_batch_size must be an integer >= 1"),
    (["--structured-output", '{"regex": "a", "choice": ["b"]}'], "give exactly one of"),
    (["--structured-output", "[1]"], "give a JSON object such as"),
    (["--structured-output", "{x"], "not valid JSON"),
    (["--structured-output", '{"regex": "a"}', "--min-tokens", "2"], "min_tokens cannot be combined"),
])
def test_generate_reports_the_dataclass_check(tmp_path, args, message):
    from kiln.runtime.cli import main

    (tmp_path / "config.json").write_text("{}")
    r = CliRunner().invoke(main, ["generate", "--engine", str(tmp_path), "--prompt", "x", *args])
    assert r.exit_code != 0 and message in r.output
