"""Damaged engine directories are refused at load with EngineLoadError naming the file or key: a few hundred
bytes flipped inside rank0.engine or rank0.weights (still valid archives), a damaged tokenizer, config.json
values that are well typed but impossible. The checksum check is skipped only when asked."""

from __future__ import annotations

import json
import shutil
import zipfile

import pytest
from click.testing import CliRunner

from kiln.contract import EngineLoadError
from kiln.runtime import LLM, Engine
from kiln.runtime.cli import main as kiln_main

from runtime_support import get_engine

pytestmark = pytest.mark.xdist_group("runtime")


@pytest.fixture
def engine_dir(checkpoint_dir, tmp_path):
    """A writable copy of the built llama test engine."""
    return shutil.copytree(get_engine(checkpoint_dir("llama")).directory, tmp_path / "engine")


def flip_bytes(path, count=400) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + count] = bytes(b ^ 0x5A for b in data[mid:mid + count])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["rank0.engine", "rank0.weights"])
def test_flipped_bytes_in_an_engine_file_are_refused(engine_dir, monkeypatch, name):
    path = engine_dir / name
    flip_bytes(path)
    assert zipfile.is_zipfile(path)        # still an archive: only the recorded checksum tells
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is not None     # (an entry's CRC is off, which torch's loaders do not check)
    with pytest.raises(EngineLoadError, match=rf"{name}: checksum mismatch .* damaged or was changed after "
                                              r"the build; rebuild the engine"):
        Engine.from_dir(engine_dir)
    with pytest.raises(EngineLoadError, match="checksum mismatch"):
        LLM(engine_dir)
    result = CliRunner().invoke(kiln_main, ["inspect", str(engine_dir), "--load"])
    assert result.exit_code == 1 and "checksum mismatch" in result.output
    if name == "rank0.weights":   # flipped tensor data: it loads when the check is skipped (and would serve garbage)
        Engine.from_dir(engine_dir, verify=False)
        monkeypatch.setenv("KILN_SKIP_ENGINE_CHECKSUM", "1")
        Engine.from_dir(engine_dir)
    else:                         # the graph file (no weights) holds the program's text: its loader fails too
        with pytest.raises(EngineLoadError, match="rank0.engine: cannot load the cpu engine"):
            Engine.from_dir(engine_dir, verify=False)


@pytest.mark.parametrize("content", [b"", b'{"version": "1.0", "model": {', b"\x00" * 64])
def test_a_damaged_tokenizer_is_named(engine_dir, content):
    (engine_dir / "tokenizer.json").write_bytes(content)
    with pytest.raises(EngineLoadError, match=r"tokenizer\.json: checksum mismatch"):
        LLM(engine_dir)
    with pytest.raises(EngineLoadError, match=r"tokenizer\.json: not a readable tokenizer \(.+\); copy tokenizer"):
        LLM(Engine.from_dir(engine_dir, verify=False))


def test_a_missing_checksummed_file_is_named(engine_dir):
    (engine_dir / "tokenizer.json").unlink()
    with pytest.raises(EngineLoadError, match=r"tokenizer\.json: missing; the engine directory is incomplete"):
        Engine.from_dir(engine_dir)


@pytest.mark.parametrize("section, key, value, message", [
    ("model", "num_kv_heads", 0, "model.num_kv_heads=0 must be >= 1"),
    ("model", "head_dim", -16, "model.head_dim=-16 must be >= 1"),
    ("model", "norm_eps", "NaN", "'model.norm_eps' must be a finite number, got nan"),
    ("model", "vocab_size", None, "key 'model.vocab_size' is missing"),
    ("bounds", "max_seq_len", "128", "'bounds.max_seq_len' must be an integer, got '128'"),
    ("tokenizer", "eos_token_ids", [2, 10**6], "tokenizer.eos_token_ids [1000000] are outside the vocabulary"),
    (None, "format_version", "3", "engine format version '3'"),
    (None, "format_version", 2, "engine format version 2"),
    (None, "format_version", 3, "engine format version 3"),
])
def test_config_json_damage_is_named_by_llm_and_inspect(engine_dir, section, key, value, message):
    path = engine_dir / "config.json"
    text = path.read_text()
    data = json.loads(text)
    node = data[section] if section else data
    if value is None:
        del node[key]
    else:
        node[key] = value
    path.write_text(json.dumps(data).replace('"NaN"', "NaN"))   # JSON as Python writes a NaN float
    with pytest.raises(EngineLoadError, match="rebuild") as exc:
        LLM(engine_dir)
    assert message in str(exc.value), str(exc.value)
    result = CliRunner().invoke(kiln_main, ["inspect", str(engine_dir)])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
