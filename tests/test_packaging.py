"""What users install is the wheel, not the editable tree: the wheel must hold every subpackage and data
file of the source tree and the prebuilt kernel library, and a fresh virtual environment with
torch==2.13.0 and the wheel must build an engine and generate from it without compiling anything."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kiln.plugins import native

ROOT = Path(__file__).resolve().parent.parent
DATA_FOLDERS = {"csrc", "templates"}  # setup.py ships every file below these
TOP_FOLDER = "toplevel"                # setup.py installs it as the kiln package itself


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert out.returncode == 0, f"{cmd[:3]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The wheel as `make wheel` builds it (torch in the build environment: the kernels are compiled in),
    built once per session: the xdist workers share it through a lock (builds in the same tree race)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # one folder for all the workers of this session
    out = shared / "kiln-wheel"
    with open(shared / "kiln-wheel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not list(out.glob("kiln_llm-*.whl")):
            _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", out, ROOT])
    (whl,) = out.glob("kiln_llm-*.whl")
    return whl


def _expected_files() -> set[str]:
    """Every module of every package folder (a top-level folder with an __init__.py) and every file
    under its data folders, as the wheel must name them (kiln/<folder>/...; toplevel/ is kiln/ itself)."""
    expected = set()
    for init in ROOT.glob("*/__init__.py"):
        for path in init.parent.rglob("*"):
            rel = path.relative_to(ROOT)
            if not path.is_file() or "__pycache__" in rel.parts:
                continue
            if path.suffix == ".py" or DATA_FOLDERS & set(rel.parts):
                inside = rel.relative_to(TOP_FOLDER) if rel.parts[0] == TOP_FOLDER else rel
                expected.add(f"kiln/{inside.as_posix()}")
    return expected


def test_wheel_holds_every_subpackage_data_file_and_the_kernels(wheel, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _expected_files()
    assert {"kiln/__init__.py", "kiln/ondemand.py", "kiln/builder/passes/__init__.py",
            "kiln/builder/backends/__init__.py", "kiln/plugins/csrc/kiln_kernels.h"} <= expected
    missing = sorted(expected - names)
    assert not missing, (f"the wheel lacks {missing[:10]}: a package folder missing from setup.py's "
                         f"PACKAGE_FOLDERS, or data outside {sorted(DATA_FOLDERS)}")
    assert all(n.startswith(("kiln/", "kiln_llm-")) for n in names), sorted(names)
    lib = tmp_path / "kiln_kernels.so"
    lib.write_bytes(zipfile.ZipFile(wheel).read("kiln/plugins/kiln_kernels.so"))
    assert native.library_key(lib) == native.build_key()  # built from these sources, for this torch


def test_installed_wheel_builds_an_engine_and_generates(wheel, checkpoint_dir, tmp_path):
    venv = tmp_path / "venv"
    try:
        _run([sys.executable, "-m", "venv", venv])
        pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile"]  # .pyc of what runs only
        _run([*pip, "torch==2.13.0"])  # first: the CPU build, never another spec
        _run([*pip, wheel])
        ext_dir = tmp_path / "torch_extensions"  # a cold compile cache: nothing may be compiled into it
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "KILN_DISABLE_NATIVE_KERNELS", "PYTHONDONTWRITEBYTECODE")}
        env["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
        work = tmp_path / "work"  # outside the source tree
        work.mkdir()
        engine = work / "engine"
        built = _run([venv / "bin" / "build-engine", "--checkpoint", checkpoint_dir("llama"), "--output", engine,
                      "--config", ROOT / "build_configs" / "tiny-test.yaml", "--quantization", "int8_weight_only"],
                     env=env, cwd=work)
        out = _run([venv / "bin" / "kiln", "generate", "--engine", engine, "--prompt", "The kiln",
                    "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--json"], env=env, cwd=work)
        (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        installed_ids = json.loads(line)["token_ids"]
        # the prebuilt library ran: it loaded (no "unavailable" warning) and nothing was compiled
        for proc in (built, out):
            assert "native kernels unavailable" not in proc.stderr and "prebuilt kernel library" not in proc.stderr
        assert not ext_dir.exists() or not any(ext_dir.iterdir()), "the installed kiln compiled its kernels"
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # ~1 GB
    # the same greedy tokens from the source tree's runtime on the engine the installed builder wrote
    from kiln.runtime import LLM, SamplingParams

    llm = LLM(engine, max_kv_cache_tokens=256)
    try:
        ref = llm.generate("The kiln", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    finally:
        llm.shutdown()
    assert installed_ids == ref.token_ids and len(ref.token_ids) == 8
