"""What users install is the wheel, not the editable tree: the wheel, built with pip's default build isolation
(`pip install .`) and without it (`make wheel`), must hold every subpackage and data file of the source tree
and the prebuilt kernel library, and a fresh virtual environment with torch==2.13.0 and the wheel must build
an engine and generate from it, through `kiln.LLM(checkpoint)` too, without compiling anything."""

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
import yaml

from kiln.plugins import native

ROOT = Path(__file__).resolve().parent.parent
DATA_FOLDERS = {"csrc", "templates"}  # setup.py ships every file below these
TOP_FOLDER = "toplevel"                # setup.py installs it as the kiln package itself


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert out.returncode == 0, f"{cmd[:3]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


BUILD_MODES = {
    # pip's default: an isolated build environment from pyproject.toml's [build-system] (torch==2.13.0 included),
    # what `pip install .` does
    "isolated": [],
    # `make wheel`: against the torch of this environment
    "no-build-isolation": ["--no-build-isolation"],
}


@pytest.fixture(scope="session")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """The wheel of each build mode, built once per session: the xdist workers share them through a lock
    (builds in the same tree race)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # one folder for all the workers of this session
    out = {}
    with open(shared / "kiln-wheel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for mode, flags in BUILD_MODES.items():
            folder = shared / f"kiln-wheel-{mode}"
            if not list(folder.glob("kiln_llm-*.whl")):
                _run([sys.executable, "-m", "pip", "wheel", "-q", *flags, "--no-deps", "-w", folder, ROOT])
            (out[mode],) = folder.glob("kiln_llm-*.whl")
    return out


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


@pytest.mark.parametrize("mode", list(BUILD_MODES))
def test_wheel_holds_every_subpackage_data_file_and_the_kernels(wheels, mode, tmp_path):
    wheel = wheels[mode]
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


def test_installed_wheel_builds_an_engine_and_generates(wheels, checkpoint_dir, tmp_path):
    """The wheel `pip install .` builds (isolated), installed where torch is: nothing compiles at first use."""
    wheel = wheels["isolated"]
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
        # kiln.LLM(checkpoint) of the installed package, run in the source tree's root (whose folders must not
        # shadow the installed kiln), with the same build: the same tokens, from an engine in the cache
        build = {**yaml.safe_load((ROOT / "build_configs" / "tiny-test.yaml").read_text()),
                 "quantization": "int8_weight_only"}
        code = ("import json, sys, kiln; llm = kiln.LLM(sys.argv[1], build_config=json.loads(sys.argv[2]), "
                "max_kv_cache_tokens=256); print('IDS', llm.generate('The kiln', kiln.SamplingParams(max_tokens=8, "
                "temperature=0, ignore_eos=True))[0].token_ids, llm.engine.directory)")
        cached = _run([venv / "bin" / "python", "-c", code, checkpoint_dir("llama"), json.dumps(build)],
                      env={**env, "KILN_CACHE_DIR": str(work / "cache")}, cwd=ROOT)
        (line,) = [ln for ln in cached.stdout.splitlines() if ln.startswith("IDS")]
        assert line.startswith(f"IDS {installed_ids} {work / 'cache'}/"), line
        # the prebuilt library ran: it loaded (no "unavailable" warning) and nothing was compiled
        for proc in (built, out, cached):
            assert "native kernels unavailable" not in proc.stderr and "prebuilt kernel library" not in proc.stderr
        # (the kernels' tuning, measured once per machine, is cached there too: kiln_tuning/)
        compiled = [p.name for p in ext_dir.iterdir() if p.name != "kiln_tuning"] if ext_dir.exists() else []
        assert not compiled, f"the installed kiln compiled its kernels: {compiled}"
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
