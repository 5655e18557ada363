"""build-engine and kiln inspect through click's runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.builder.cli import build_engine_cmd
from kiln.builder.passes import PASS_NAMES
from kiln.runtime.cli import main as kiln_main

TINY_YAML = Path(__file__).resolve().parent.parent / "build_configs" / "tiny-test.yaml"


def test_passes_are_listed():
    result = CliRunner().invoke(build_engine_cmd, ["--passes"])
    assert result.exit_code == 0
    for name in PASS_NAMES:
        assert name in result.output


def test_build_with_yaml_and_flag_overrides_then_inspect(checkpoint_dir, tmp_path):
    out = tmp_path / "eng"
    result = CliRunner().invoke(build_engine_cmd, [
        "--checkpoint", str(checkpoint_dir("gpt2")), "--output", str(out), "--config", str(TINY_YAML),
        "--max-batch-size", "2", "--tokens-per-block", "8", "--disable-pass", "merge_qkv",
    ])
    assert result.exit_code == 0, result.output
    for stage in ("[1/7] load", "[2/7] trace", "[3/7] passes", "[6/7] compile", "[7/7] write"):
        assert stage in result.output
    for row in ("weights", "activation peak", "KV bytes/token", "KV tokens in 1 GiB", "build time"):
        assert row in result.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["build"]["max_batch_size"] == 2 and cfg["build"]["tokens_per_block"] == 8  # flags
    assert cfg["build"]["max_num_tokens"] == 64 and cfg["build"]["max_seq_len"] == 128  # yaml
    assert cfg["build"]["disabled_passes"] == ["merge_qkv"]
    report = json.loads((out / "build_report.json").read_text())
    assert report["passes"]["merge_qkv"] == "disabled"

    inspected = CliRunner().invoke(kiln_main, ["inspect", str(out), "--load"])
    assert inspected.exit_code == 0, inspected.output
    assert "KV bytes/token" in inspected.output and f"{cfg['memory']['kv_bytes_per_token']} B" in inspected.output
    assert "GPT2LMHeadModel" in inspected.output and "merge_qkv (off)" in inspected.output
    # the kernel and tuning of each linear (fp32 panels of this machine's ISA) at decode, batch and prefill
    assert "kernels (ISA " in inspected.output and "row_prefetch" in inspected.output
    assert "fp32 panels, avx" in inspected.output and "decode: " in inspected.output
    assert "batch 2: " in inspected.output and "prefill 64: " in inspected.output
    # which attention its context sequences run here: kiln's kernel or SDPA, and why
    assert "context attention: kiln causal attention kernel (" in inspected.output or \
        "context attention: torch SDPA (" in inspected.output
    as_json = CliRunner().invoke(kiln_main, ["inspect", str(out), "--json"])
    assert json.loads(as_json.output)["build"]["max_batch_size"] == 2
    io = CliRunner().invoke(kiln_main, ["inspect", str(out), "--io"]).output   # the I/O contract of this engine
    assert "input  input_ids       int64    [num_tokens [1, 64]]" in io
    assert "input  block_tables    int32    [num_seqs [1, 2], max_blocks_per_seq [1, 16]]" in io
    assert "output logits          float32  [num_logits [0, 2], 512]" in io


def test_max_seq_len_alone_sets_the_prompt_bound_too(checkpoint_dir, tmp_path):
    """`build-engine --max-seq-len 64` with no --max-input-len: the prompt bound follows (it used to fail with
    the default max_input_len=512 > 64); an unknown flag near a real one is named."""
    out = tmp_path / "short"
    result = CliRunner().invoke(build_engine_cmd, ["--checkpoint", str(checkpoint_dir("gpt2")), "--output", str(out),
                                                   "--max-seq-len", "64", "--max-batch-size", "2"])
    assert result.exit_code == 0, result.output
    build = json.loads((out / "config.json").read_text())["build"]
    assert (build["max_input_len"], build["max_seq_len"], build["max_num_tokens"]) == (64, 64, 1024)
    typo = CliRunner().invoke(build_engine_cmd, ["--checkpoint", "c", "--output", "o", "--max-seqlen", "64"])
    assert typo.exit_code == 2 and "--max-seq-len" in typo.output   # click's own "Did you mean" for flags


@pytest.mark.parametrize("args, message", [
    (["--max-seq-len", "64", "--max-input-len", "128"], "max_input_len=128 > max_seq_len=64"),
    (["--max-seq-len", "100000", "--max-input-len", "64"], "max_position_embeddings"),
    (["--disable-pass", "nonsense"], "unknown pass"),
])
def test_build_errors_are_clear(checkpoint_dir, tmp_path, args, message):
    result = CliRunner().invoke(build_engine_cmd, [
        "--checkpoint", str(checkpoint_dir("gpt2")), "--output", str(tmp_path / "x"), *args])
    assert result.exit_code != 0
    assert message in result.output
    assert not (tmp_path / "x").exists()


def test_missing_arguments_and_bad_engine(tmp_path):
    result = CliRunner().invoke(build_engine_cmd, ["--output", str(tmp_path)])
    assert result.exit_code != 0 and "--checkpoint and --output are required" in result.output
    result = CliRunner().invoke(kiln_main, ["inspect", str(tmp_path)])
    assert result.exit_code != 0 and "config.json: missing" in result.output


def test_output_dir_is_never_a_foreign_directory(checkpoint_dir, tmp_path):
    ckpt = checkpoint_dir("gpt2")
    result = CliRunner().invoke(build_engine_cmd, ["--checkpoint", str(ckpt), "--output", str(ckpt)])
    assert result.exit_code != 0 and "would replace the checkpoint" in result.output
    assert (ckpt / "config.json").is_file()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    result = CliRunner().invoke(build_engine_cmd, ["--checkpoint", str(ckpt), "--output", str(foreign)])
    assert result.exit_code != 0 and "refusing to replace it" in result.output
    assert (foreign / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("where", ["file_parent", "sysfs"])
def test_an_unusable_output_is_named_before_the_build_starts(checkpoint_dir, tmp_path, monkeypatch, where):
    """An output whose parent is a file, or where nothing can be created, fails before the load stage, naming
    the path as it was given (relative stays relative)."""
    monkeypatch.chdir(tmp_path)
    if where == "file_parent":
        (tmp_path / "notes.txt").write_text("a file")
        given_path, reason = "notes.txt/engine", "notes.txt is not a directory"
    else:
        given_path, reason = "/sys/kiln-test-engine", "cannot create"
    result = CliRunner().invoke(build_engine_cmd, ["--checkpoint", str(checkpoint_dir("gpt2")), "--output", given_path])
    assert result.exit_code == 1, result.output
    assert f"output {given_path}: " in result.output and reason in result.output, result.output
    assert "[1/7] load" not in result.output and "Traceback" not in result.output
    assert not list(tmp_path.glob("*.tmp-build"))


def test_a_missing_checkpoint_is_reported_as_missing(tmp_path):
    result = CliRunner().invoke(build_engine_cmd, ["--checkpoint", str(tmp_path / "nowhere"),
                                                   "--output", str(tmp_path / "eng")])
    assert result.exit_code == 1 and f"checkpoint directory {tmp_path / 'nowhere'} does not exist" in result.output
    assert not (tmp_path / "eng").exists()


def test_8bit_kv_build_reports_its_accuracy(checkpoint_dir, tmp_path):
    """--kv-cache-dtype int8: the accuracy stage runs after the passes, its report (against the float32 pool, on text
    the checkpoint writes) lands in build_report.json and in the summary build-engine and kiln inspect print;
    --kv-calibration FILE measures on the file's paragraphs instead."""
    ckpt, out = checkpoint_dir("llama"), tmp_path / "eng"
    result = CliRunner().invoke(build_engine_cmd, ["--checkpoint", str(ckpt), "--output", str(out),
                                                   "--config", str(TINY_YAML), "--kv-cache-dtype", "int8"])
    assert result.exit_code == 0, result.output
    for stage in ("[1/8] load", "[3/8] passes", "[4/8] kv_accuracy", "[5/8] export", "[8/8] write"):
        assert stage in result.output
    acc = json.loads((out / "build_report.json").read_text())["kv_cache_accuracy"]
    assert acc["kv_cache_dtype"] == "int8" and acc["reference_kv_cache_dtype"] == "float32"
    assert acc["prompts"] == 4 and acc["positions"] == 4 * 63 and "own text" in acc["calibration"]
    assert acc["top1_agreement"] >= 0.9 and 0 < acc["mean_abs_logit_error"] < acc["max_abs_logit_error"] < 1.0
    assert "KV cache accuracy" in result.output and "| int8 vs float32 pool, 252 positions" in result.output
    inspected = CliRunner().invoke(kiln_main, ["inspect", str(out)])
    assert "KV cache accuracy" in inspected.output and "top-1 agreement" in inspected.output

    text = tmp_path / "prompts.txt"
    text.write_text("The kiln fires the clay slowly.\n\nTokens flow through the engine,\none at a time.\n\n\n"
                    "Memory is the wall: every token keeps its keys and values.\n")
    result = CliRunner().invoke(build_engine_cmd, ["--checkpoint", str(ckpt), "--output", str(out), "--config",
                                                   str(TINY_YAML), "--kv-cache-dtype", "fp8",
                                                   "--kv-calibration", str(text)])
    assert result.exit_code == 0, result.output
    acc = json.loads((out / "build_report.json").read_text())["kv_cache_accuracy"]
    assert acc["kv_cache_dtype"] == "fp8" and acc["prompts"] == 3 and acc["calibration"] == "prompts.txt (3 paragraphs)"
    assert 0 < acc["positions"] < 100 and acc["top1_agreement"] > 0.5


@pytest.mark.parametrize("args, message", [
    (["--kv-cache-dtype", "int8", "--kv-calibration", "nowhere.txt"], "kv_calibration nowhere.txt: cannot read it"),
    (["--kv-calibration", "prompts.txt"], "calibrates the accuracy report of an 8-bit KV cache"),
    (["--kv-cache-dtype", "fp8", "--backend", "onnx"], "ONNX has no bit cast"),
])
def test_8bit_kv_errors_are_clear(checkpoint_dir, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(build_engine_cmd, [
        "--checkpoint", str(checkpoint_dir("llama")), "--output", str(tmp_path / "x"), *args])
    assert result.exit_code != 0 and message in result.output, result.output
    assert "[1/" not in result.output and not (tmp_path / "x").exists()
