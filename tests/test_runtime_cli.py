"""`kiln generate` on a built engine."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kiln.runtime.cli import main

from runtime_support import get_engine

pytestmark = pytest.mark.xdist_group("runtime")


def test_kiln_generate(checkpoint_dir):
    engine = get_engine(checkpoint_dir("llama"))
    runner = CliRunner()
    res = runner.invoke(main, ["generate", "--engine", str(engine.directory), "--prompt", "The kiln fires",
                               "--prompt", "Tokens flow", "--max-tokens", "6", "--ignore-eos"])
    assert res.exit_code == 0, res.output
    assert res.output.count("[6 tokens, length") == 2 and "TTFT p50" in res.output
    res = runner.invoke(main, ["generate", "--engine", str(engine.directory), "--prompt", "Héllo", "--max-tokens", "4",
                               "--json", "--temperature", "0.8", "--seed", "1"])
    assert res.exit_code == 0, res.output
    (line,) = [json.loads(x) for x in res.output.splitlines() if x.startswith("{")]
    assert line["prompt"] == "Héllo" and len(line["token_ids"]) <= 4 and line["metrics"]["ttft"] > 0
    res = runner.invoke(main, ["generate", "--engine", str(engine.directory), "--prompt", "x", "--max-tokens", "5000"])
    assert res.exit_code != 0 and "max_seq_len" in res.output
