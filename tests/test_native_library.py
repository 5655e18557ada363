"""The native kernel library's loader (kiln.plugins.native): constants read from the C++ header, the
build key that keeps a stale library from loading, the prebuilt library, and the plain-torch fallback
when the library is unavailable or disabled."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from kiln.plugins import linear
from kiln.plugins import native as native_lib
from kiln.plugins import weight_format as fmt

from bench_common import stream_read_bandwidth

ops = torch.ops.kiln


def test_abi_constants_come_from_the_header():
    abi = native_lib.ABI
    assert abi.weight_types == {"bf16": 0, "int8": 1, "int4": 2, "fp32": 3, "bf16_packed": 4,
                                "fp32_packed": 5, "int8_packed": 6, "fp32_panel": 7, "bf16_panel": 8,
                                "int8_panel": 9, "int4_panel": 10}
    assert (abi.row_tile, abi.k_step, abi.max_m, abi.panel, abi.pair, abi.int4_block) == (8, 16, 64, 16, 2, 8)
    assert (fmt.ROW_TILE, fmt.K_STEP, fmt.PANEL, fmt.PAIR) == (abi.row_tile, abi.k_step, abi.panel, abi.pair)


def test_abi_reader_names_a_missing_constant(tmp_path):
    header = tmp_path / "kiln_kernels.h"
    header.write_text("constexpr int KILN_ROW_TILE = 8;\nconstexpr int KILN_K_STEP = 16;\n")
    with pytest.raises(RuntimeError, match="KILN_MAX_M not found"):
        native_lib._read_abi(header)


def test_build_key_covers_sources_flags_and_torch(monkeypatch, tmp_path):
    key = native_lib.build_key()
    assert key == native_lib.build_key(torch.__version__) and key.isidentifier()
    assert native_lib.build_key("0.0.1") != key  # a library built for another torch is stale
    monkeypatch.setattr(native_lib, "CFLAGS", (*native_lib.CFLAGS, "-DEXTRA"))
    assert native_lib.build_key() != key
    monkeypatch.undo()
    src = tmp_path / "extra.cpp"
    src.write_text("// changed sources\n")
    monkeypatch.setattr(native_lib, "SOURCES", native_lib.SOURCES + [src])
    assert native_lib.build_key() != key


def test_loaded_library_carries_this_build_key(native):
    assert native_lib.library_key(Path(native._name)) == native_lib.build_key()
    # the ops dispatch straight to the C++ kernels (no Python per call)
    assert all(native_lib._cpp_kernel_registered(op) for op in
               ("weight_only_linear", "bf16_linear", "fp32_linear", "rms_norm", "paged_attention"))


# Run in a process of its own: where the key check compiles the library, torch's extension loader also loads that
# copy, whose C++ kernels then serve the ops for the rest of the process, with their own thresholds (int4_gemm_m,
# bf16_gemm_m, max_m) that the setters of the first copy do not reach; later kernel tests in the same worker
# would run the wrong route.
_PREBUILT_KEY_CHECK = r"""
import sys, warnings
from pathlib import Path
import torch
from kiln.plugins import linear, native as native_lib, weight_format as fmt
assert native_lib.library() is not None
key = native_lib.build_key()
prebuilt = Path(sys.argv[1]) / "kiln_kernels.so"
native_lib.PREBUILT = prebuilt
prebuilt.write_bytes(b"\x7fELF...kiln-build-key:" + key.encode() + b"\0...")
assert native_lib._library_path(key) == prebuilt
# stale (other sources or another torch): not loaded; compiled (or found in the JIT cache) instead
prebuilt.write_bytes(b"\x7fELF...kiln-build-key:kstale\0...")
native_lib._warned = set()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    path = native_lib._library_path(key)
assert any("built from other sources or for another torch" in str(w.message) for w in caught), caught
assert path != prebuilt and native_lib.library_key(path) == key
# where that compiled it, the loader also loaded that copy, whose C++ kernels now serve the ops: disabling the
# native kernels must reach it too
g = torch.Generator().manual_seed(3)
q, s = fmt.quantize_int8(torch.randn(40, 128, generator=g))
x = torch.randn(3, 128, generator=g)
with native_lib.native_kernels_disabled():
    assert torch.equal(torch.ops.kiln.weight_only_linear(x, q, s, None, 8, 0),
                       linear.weight_only_linear_reference(x, q, s, None, 8, 0))
print("ok")
"""


def test_prebuilt_library_is_used_only_when_its_key_matches(native, tmp_path):
    done = subprocess.run([sys.executable, "-c", _PREBUILT_KEY_CHECK, str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_build_failure_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(native_lib, "_state", "unloaded")
    monkeypatch.setattr(native_lib, "_lib", None)
    monkeypatch.setattr(native_lib, "_warned", set())
    monkeypatch.setattr(native_lib, "_cpu_has_avx2_fma", lambda: False)
    w = torch.randn(16, 64)
    x = torch.randn(2, 64)
    q, s = fmt.quantize_int8(w)
    # (the Python implementation: in this process the C++ kernel may already be registered)
    with pytest.warns(RuntimeWarning, match="AVX2"):
        y = ops._weight_only_linear_py(x, q, s, None, 8, 0)
    torch.testing.assert_close(y, linear.weight_only_linear_reference(x, q, s, None, 8, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        ops._weight_only_linear_py(x, q, s, None, 8, 0)


def test_env_var_disables_native_kernels():
    code = (
        "import torch, warnings; warnings.simplefilter('error');"
        "from kiln.plugins import linear, native, weight_format as fmt;"
        "assert not native.native_kernels_available();"
        "w = torch.randn(8, 64); q, s = fmt.quantize_int8(w); x = torch.randn(1, 64);"
        "torch.testing.assert_close(torch.ops.kiln.weight_only_linear(x, q, s, None, 8, 0),"
        " linear.weight_only_linear_reference(x, q, s, None, 8, 0)); print('ok')"
    )
    env = {**os.environ, "KILN_DISABLE_NATIVE_KERNELS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok" in out.stdout


def test_stream_read_kernel_sums_correctly(native):
    buf = torch.ones(64 * 1000 + 37)
    assert native.kiln_stream_sum(buf.data_ptr(), buf.numel(), 2) == buf.numel()
    assert stream_read_bandwidth(nbytes=1 << 20, repeats=2) > 0


def test_a_jit_compiled_library_is_found_without_the_extension_loader(tmp_path, monkeypatch):
    """Loading a library compiled earlier must not import torch.utils.cpp_extension (setuptools and ~95 modules
    of resident memory): native.py finds it in TORCH_EXTENSIONS_DIR by name and checks its build key."""
    key = "kdeadbeef"
    name = f"{native_lib.LIBRARY_NAME}_{key}"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert native_lib._jit_cached(key) is None                       # nothing there
    (tmp_path / name).mkdir()
    so = tmp_path / name / f"{name}.so"
    so.write_bytes(b"\x7fELF...kiln-build-key:kother\0")
    assert native_lib._jit_cached(key) is None                       # another build's library
    so.write_bytes(b"\x7fELF...kiln-build-key:" + key.encode() + b"\0")
    assert native_lib._jit_cached(key) == so
    (tmp_path / name / "lock").write_text("")                         # another process is still compiling it
    assert native_lib._jit_cached(key) is None
