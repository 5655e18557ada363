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


def test_kiln_generate_streams_every_prompt(checkpoint_dir):
    """--stream with several prompts: all run concurrently; each prompt's text is printed under its header, one
    prompt after the other (the next one's text, generated meanwhile, comes out at once), as without --stream."""
    engine = get_engine(checkpoint_dir("llama"))
    args = ["generate", "--engine", str(engine.directory), "--prompt", "The kiln fires", "--prompt", "Tokens flow",
            "--prompt", "Héllo", "--max-tokens", "6", "--ignore-eos", "--temperature", "0", "--quiet-metrics"]
    runner = CliRunner()
    plain = runner.invoke(main, args)
    streamed = runner.invoke(main, [*args, "--stream"])
    assert plain.exit_code == 0 and streamed.exit_code == 0, streamed.output
    texts = [json.loads(x)["text"] for x in runner.invoke(main, [*args, "--json"]).output.splitlines()]
    assert len(texts) == 3 and all(texts)
    for prompt, text in zip(("The kiln fires", "Tokens flow", "Héllo"), texts):
        assert f"--- {prompt!r}\n{text}\n    [6 tokens, length" in streamed.output, streamed.output
    strip = [line for line in streamed.output.splitlines() if not line.startswith("    [")]
    assert strip == [line for line in plain.output.splitlines() if not line.startswith("    [")]


def test_kiln_generate_refuses_a_seed_that_fits_no_generator(checkpoint_dir):
    engine = get_engine(checkpoint_dir("llama"))
    res = CliRunner().invoke(main, ["generate", "--engine", str(engine.directory), "--prompt", "x",
                                    "--seed", "1180591620717411303424", "--temperature", "1"])
    assert res.exit_code == 1 and "seed must be an integer in [0, 2**64)" in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
