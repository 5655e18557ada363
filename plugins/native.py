"""The native kernel library: one shared library, ``kiln_kernels``, with the CPU kernels of every plugin op.

Where the library comes from, in this order:

1. prebuilt: ``kiln_kernels.so`` next to this module, compiled when the wheel was built (``setup.py``
   with torch's ``BuildExtension``); used when its build key matches this install's;
2. compiled on first use with ``torch.utils.cpp_extension.load`` (~20 s on 2 cores) into
   TORCH_EXTENSIONS_DIR, under a name that carries the build key, so a stale cache is never loaded
   (a source checkout, or a wheel whose prebuilt library does not match, e.g. after a torch upgrade);
3. neither (no compiler, a CPU without AVX2/FMA): the ops' plain-torch implementations, after a
   one-time warning. ``KILN_DISABLE_NATIVE_KERNELS=1`` (or :func:`set_native_kernels_enabled`) forces
   them too.

The build key is a hash of the C++ sources and headers, the compiler flags and the torch version: the
library links against libtorch, so a library built for another torch must not be loaded. It is
compiled into the library as a string and read back from the file, without loading it (loading
registers the library's op kernels with the dispatcher, which cannot be undone).

The constants that Python and C++ share (weight-type ids, the packed tile shape, the rows of x per
kernel call) are defined once, in ``csrc/kiln_kernels.h``; :data:`ABI` reads them from that text, the
same text the library was compiled from (the build key covers it).

The ops themselves are defined by their plugin modules with :func:`define_native_op`: plain
``torch.library`` ops whose CPU kernel is the C++ one once the library is loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "ABI", "CSRC_DIR", "SOURCES", "HEADERS", "CFLAGS", "LDFLAGS", "LIBRARY_NAME", "PREBUILT",
    "build_key", "library", "native_kernels_available", "set_native_kernels_enabled",
    "native_kernels_disabled", "native_op_ready", "define_native_op", "panel_isa", "set_panel_isa",
    "kernel_tuning", "describe_kernel", "cpu_flags", "cpu_info",
]

logger = logging.getLogger("kiln.plugins")

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = sorted(CSRC_DIR.glob("*.cpp"))
HEADERS = sorted(CSRC_DIR.glob("*.h"))
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17")
LDFLAGS = ("-fopenmp",)  # tuples: cpp_extension extends the lists it is given
LIBRARY_NAME = "kiln_kernels"
PREBUILT = Path(__file__).resolve().parent / f"{LIBRARY_NAME}.so"
_KEY_MARK = b"kiln-build-key:"  # csrc/kiln_kernels.h: kiln_build_key = "kiln-build-key:" KILN_BUILD_KEY


# --------------------------------------------------------------------------------------------
# the constants shared with C++ (read from the header)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Abi:
    """The C++ constants Python needs, as ``csrc/kiln_kernels.h`` defines them."""

    weight_types: dict[str, int]  # kiln_linear's weight type ids: "bf16", "int8_packed", "fp32_panel", ...
    row_tile: int  # packed weights [out/row_tile, in/k_step, row_tile, k_step]
    k_step: int
    max_m: int  # rows of x per kiln_linear call (bigger M is cut into calls of this size; panels: any M)
    panel: int  # panel layouts: fp32 [out/panel, in, panel], bf16/int8 [out/panel, in/pair, panel, pair]
    pair: int
    int4_block: int  # int4 panels [out/panel, in/int4_block, 64]


def _read_abi(header: Path) -> Abi:
    text = header.read_text()
    consts = {name: int(v) for name, v in re.findall(r"constexpr\s+\w+\s+KILN_([A-Z0-9_]+)\s*=\s*(\d+)\s*;", text)}
    wtypes = {name.lower(): int(v) for name, v in re.findall(r"\bKILN_W_([A-Z0-9_]+)\s*=\s*(\d+)", text)}
    try:
        return Abi(wtypes, consts["ROW_TILE"], consts["K_STEP"], consts["MAX_M"], consts["PANEL"], consts["PAIR"],
                   consts["INT4_BLOCK"])
    except KeyError as exc:
        raise RuntimeError(f"{header}: constant KILN_{exc.args[0]} not found; the header and "
                           f"kiln/plugins/native.py disagree") from None


ABI = _read_abi(CSRC_DIR / "kiln_kernels.h")


# --------------------------------------------------------------------------------------------
# build key and loading
# --------------------------------------------------------------------------------------------


def build_key(torch_version: str | None = None) -> str:
    """Hash of what the library is made of: sources, headers, flags and the torch version it links."""
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(" ".join([*CFLAGS, "|", *LDFLAGS]).encode())
    h.update((torch_version or torch.__version__).encode())
    return "k" + h.hexdigest()[:24]  # a C identifier: passed as -DKILN_BUILD_KEY=<key>, stringified there


def key_define(key: str) -> str:
    return f"-DKILN_BUILD_KEY={key}"


def library_key(path: Path) -> str | None:
    """The build key compiled into the library file at ``path`` (read from its bytes, not loaded). Read in
    1 MiB pieces: the whole 15 MB file as one bytes object stayed in the process's heap after it was freed
    (+15 MB of resident memory for the life of every process that loads an engine)."""
    piece, keep = 1 << 20, len(_KEY_MARK) + 64   # a key is 25 characters; the mark may straddle two pieces
    tail = b""
    with open(path, "rb") as f:
        while chunk := f.read(piece):
            data = tail + chunk
            i = data.find(_KEY_MARK)
            if i >= 0:
                rest = data[i + len(_KEY_MARK):] + f.read(64)
                return rest[:rest.index(b"\0")].decode("ascii", "replace")
            tail = data[-keep:]
    return None


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
# every copy of the library this process opened: the dispatcher runs the C++ kernels of the last one registered,
# which need not be _lib (a stale prebuilt file and its compiled replacement, a handle reset), and each copy has its
# own enabled flag
_opened: list[ctypes.CDLL] = []
_state = "unloaded"  # unloaded | ok | failed
_enabled = os.environ.get("KILN_DISABLE_NATIVE_KERNELS", "0") in ("", "0", "false", "False")
_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def cpu_info() -> dict[str, str]:
    """The first processor's ``vendor_id``, ``cpu family``, ``model`` and ``flags`` as /proc/cpuinfo gives them
    (those it cannot read are absent); read once: the one reader of that file."""
    global _info
    if _info is None:
        found: dict[str, str] = {}
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    key = key.strip()
                    if key in ("vendor_id", "cpu family", "model", "flags") and key not in found:
                        found[key] = value.strip()
                    if len(found) == 4:
                        break
        except OSError:
            pass
        _info = found
    return _info


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    return frozenset(cpu_info().get("flags", "").split())


_info: dict[str, str] | None = None


def _cpu_has_avx2_fma() -> bool:
    flags = cpu_flags()
    if flags:
        return {"avx2", "fma"} <= flags
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _library_path(key: str) -> Path:
    """The prebuilt library if it matches ``key``, else one compiled now (or found in the JIT cache)."""
    if PREBUILT.is_file():
        found = library_key(PREBUILT)
        if found == key:
            return PREBUILT
        _warn_once("stale", f"kiln: the prebuilt kernel library {PREBUILT} was built from other sources or "
                            f"for another torch (key {found}, this install {key}); compiling it now (~20 s)")
    cached = _jit_cached(key)
    if cached is not None:   # compiled before: no need to import torch.utils.cpp_extension (and setuptools)
        return cached
    from torch.utils import cpp_extension

    logger.info("compiling kiln's native kernels (first use, ~20 s; cached in TORCH_EXTENSIONS_DIR)")
    path = Path(cpp_extension.load(
        name=f"{LIBRARY_NAME}_{key}",
        sources=[str(p) for p in SOURCES],
        extra_cflags=[*CFLAGS, key_define(key)],
        extra_ldflags=list(LDFLAGS),
        is_python_module=False,
        verbose=False,
    ))
    # the loader has also loaded it, so its C++ kernels now serve the ops: it must see the enabled flag (else a
    # later native_kernels_disabled() leaves this copy's kernels running)
    _track(path)
    return path


def _track(path: Path) -> ctypes.CDLL:
    """Open the library at ``path`` (once per copy), remember it in ``_opened`` and give it the enabled flag. Opened
    into the global scope (RTLD_GLOBAL; a copy the extension loader opened before is promoted), where a cpu-compiled
    engine's graph finds the ops' C shims (kiln.plugins.aoti_shims)."""
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    known = next((o for o in _opened if o._handle == lib._handle), None)
    if known is None:
        _declare(lib)
        _opened.append(lib)
        known = lib
    known.kiln_ops_set_enabled(int(_enabled))
    return known


def _jit_cached(key: str) -> Path | None:
    """The library torch's extension loader compiled for ``key`` earlier, where it keeps it (TORCH_EXTENSIONS_DIR,
    else ~/.cache/torch_extensions/py<version>_<cpu|cuXY>), when it is there, complete and carries the key. While
    another process compiles it (the loader's ``lock`` file is in its folder) the file may be half written: None,
    and the loader waits for that build."""
    name = f"{LIBRARY_NAME}_{key}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        cu = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        root = str(Path.home() / ".cache" / "torch_extensions" / f"py{sys.version_info[0]}{sys.version_info[1]}_{cu}")
    path = Path(root) / name / f"{name}.so"
    try:
        if (path.parent / "lock").exists():
            return None
        return path if path.is_file() and library_key(path) == key else None
    except OSError:
        return None


def _declare(lib: ctypes.CDLL) -> None:
    """The ctypes signatures of the library's C functions (csrc/kiln_kernels.h)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kiln_linear.argtypes = [ctypes.c_int, ptr, ptr, i64, ptr, i64, i64, i64, ptr, ptr, ctypes.c_int, ctypes.c_int]
    lib.kiln_linear.restype = ctypes.c_int
    lib.kiln_dequant_rows.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, i64, i64, i64, ptr, ctypes.c_int]
    lib.kiln_dequant_rows.restype = ctypes.c_int
    lib.kiln_panel_isa.restype = ctypes.c_int
    lib.kiln_set_panel_isa.argtypes = [ctypes.c_int]
    lib.kiln_set_panel_isa.restype = ctypes.c_int
    lib.kiln_stream_sum.argtypes = [ptr, i64, ctypes.c_int]
    lib.kiln_stream_sum.restype = ctypes.c_double
    lib.kiln_openmp_region_us.argtypes = [ctypes.c_int]
    lib.kiln_openmp_region_us.restype = ctypes.c_double
    lib.kiln_linear_int4_panel.argtypes = [ptr, ptr, ptr, i64, ptr, i64, i64, i64, ptr, ptr, ctypes.c_int,
                                           ctypes.c_int]
    lib.kiln_linear_int4_panel.restype = ctypes.c_int
    lib.kiln_int4_x_bits.restype = ctypes.c_int
    lib.kiln_set_int4_x_bits.argtypes = [ctypes.c_int]
    lib.kiln_set_int4_x_bits.restype = ctypes.c_int
    lib.kiln_get_tuning.argtypes = [ctypes.c_char_p, ctypes.POINTER(i64)]
    lib.kiln_get_tuning.restype = ctypes.c_int
    lib.kiln_set_tuning.argtypes = [ctypes.c_char_p, i64]
    lib.kiln_set_tuning.restype = ctypes.c_int
    lib.kiln_describe_kernel.argtypes = [ctypes.c_int, i64, i64, ctypes.c_char_p, i64]
    lib.kiln_describe_kernel.restype = ctypes.c_int
    lib.kiln_ops_set_enabled.argtypes = [ctypes.c_int]
    lib.kiln_ops_max_m.argtypes = [ctypes.c_int]
    lib.kiln_ops_max_m.restype = i64
    lib.kiln_ops_int4_gemm_m.restype = i64
    lib.kiln_ops_set_int4_gemm_m.argtypes = [i64]
    lib.kiln_ops_bf16_gemm_m.restype = i64
    lib.kiln_ops_fp32_gemm_m.restype = i64
    lib.kiln_ops_set_fp32_gemm_m.argtypes = [i64]
    lib.kiln_ops_set_fp32_gemm_m.restype = ctypes.c_int
    lib.kiln_ops_set_bf16_gemm_m.argtypes = [i64]
    lib.kiln_ops_set_bf16_gemm_m.restype = ctypes.c_int
    lib.kiln_dequant_int4_panel_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.kiln_dequant_int4_panel_bf16.restype = ctypes.c_int
    lib.kiln_ops_set_max_m.argtypes = [ctypes.c_int, i64]
    lib.kiln_causal_attention_available.restype = ctypes.c_int
    lib.kiln_causal_attention_bf16.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float,
                                               ctypes.c_int, ptr, i64, i64]
    lib.kiln_causal_attention_bf16.restype = ctypes.c_int
    lib.kiln_causal_attention_f32.argtypes = lib.kiln_causal_attention_bf16.argtypes
    lib.kiln_causal_attention_f32.restype = ctypes.c_int
    lib.kiln_causal_attention_amx.restype = ctypes.c_int
    lib.kiln_causal_attention_set_amx.argtypes = [ctypes.c_int]
    lib.kiln_causal_attention_set_amx.restype = ctypes.c_int
    lib.kiln_block_cache_install.argtypes = [i64, i64]
    lib.kiln_block_cache_install.restype = ctypes.c_int
    lib.kiln_block_cache_stats.argtypes = [ptr]
    lib.kiln_block_cache_stats.restype = ctypes.c_int


def _load() -> ctypes.CDLL | None:
    global _lib, _state
    if _state != "unloaded":
        return _lib
    with _lock:
        if _state != "unloaded":
            return _lib
        try:
            if not _cpu_has_avx2_fma():
                raise RuntimeError("this CPU lacks AVX2/FMA")
            key = build_key()
            path = _library_path(key)
            if library_key(path) != key:
                raise RuntimeError(f"{path} does not carry build key {key}")
            lib = _track(path)
            for opened in _opened:
                opened.kiln_ops_set_enabled(int(_enabled))
            _apply_tuning(lib, key)
            _apply_fp32_matmul(lib)
            _install_block_cache(lib)
            _lib, _state = lib, "ok"
        except Exception as e:  # compile error, missing compiler, no AVX2 ...
            _state = "failed"
            _warn_once("load", f"kiln: native kernels unavailable ({type(e).__name__}: {str(e)[:500]}); "
                               "using the slower plain-torch path")
        return _lib


def _apply_tuning(lib: ctypes.CDLL, key: str) -> None:
    """This machine's kernel tunables (kiln.plugins.tuning); a failure keeps the library's defaults."""
    from kiln.plugins import tuning

    try:
        tuning.apply(lib, key)
    except Exception as e:  # a bad KILN_TUNING, an unwritable cache: the kernels still run, untuned
        _warn_once("tuning", f"kiln: kernel tuning not applied ({type(e).__name__}: {str(e)[:300]}); "
                             "using the per-CPU defaults")


FP32_MATMUL_ENV = "KILN_FP32_MATMUL"
FP32_MATMUL_CHOICES = ("high", "highest")
FP32_SPLIT_M = 64   # rows from which KILN_FP32_MATMUL=high runs fp32 GEMMs on AMX tiles (kiln.plugins.linear)


def _apply_fp32_matmul(lib: ctypes.CDLL) -> None:
    """KILN_FP32_MATMUL, read here only: 'high' turns on the split-bf16 AMX route for fp32 GEMMs from FP32_SPLIT_M
    rows where the CPU has AMX-BF16 and the OS grants tile state (elsewhere it stays off); 'highest' (the default)
    keeps exact fp32 products; anything else is warned about and means 'highest'."""
    value = os.environ.get(FP32_MATMUL_ENV, "highest")
    if value not in FP32_MATMUL_CHOICES:
        _warn_once("fp32_matmul", f"{FP32_MATMUL_ENV}={value!r} is not one of {FP32_MATMUL_CHOICES}: fp32 linears "
                                  "keep exact fp32 products ('highest'); 'high' lets prefill GEMMs run on AMX tiles "
                                  "with split-bf16 operands")
    if value == "high":
        lib.kiln_ops_set_fp32_gemm_m(FP32_SPLIT_M)   # refused (0) without AMX tiles: exact fp32 then


def _install_block_cache(lib: ctypes.CDLL) -> None:
    """torch's CPU allocator keeps large freed blocks (kiln.plugins.block_cache); a bad setting keeps torch's."""
    from kiln.plugins import block_cache

    try:
        block_cache.install(lib)
    except ValueError as e:
        _warn_once("block_cache", f"kiln: large-block reuse not installed ({e}); using torch's CPU allocator")


def kernel_tuning() -> dict[str, int]:
    """The panel kernels' tunables in use (prefetch distances in bytes); {} without the native library."""
    from kiln.plugins import tuning

    lib = library()
    return tuning.current(lib) if lib is not None else {}


def describe_kernel(kind: str, m: int, n: int) -> str:
    """Which kernel (ISA, blocking, prefetch distance) a panel weight of ``kind`` ('int4_panel', 'int8_panel',
    'fp32_panel', 'bf16_panel') with ``n`` outputs runs at ``m`` rows of x."""
    from kiln.plugins import tuning

    lib = library()
    if lib is None:
        return "plain torch (no native kernels)"
    return tuning.describe_kernel(lib, ABI.weight_types[kind], m, n)


def load_for_compiled_engines() -> bool:
    """Load the library even where its kernels are disabled (KILN_DISABLE_NATIVE_KERNELS: the ops' C++ kernels then
    run their Python implementations), so that a cpu-compiled engine's calls to the ops' C shims resolve; False
    when it cannot load here."""
    return _load() is not None


def library() -> ctypes.CDLL | None:
    """The loaded library (loading or compiling it on the first call), or None when the native kernels
    are disabled or unavailable."""
    return _load() if _enabled else None


def native_kernels_available() -> bool:
    """True if the native kernels are enabled and loaded (loads them on the first call)."""
    return library() is not None


def panel_isa() -> int:
    """Vector width (bits) of the panel kernels: 512 on CPUs with AVX-512 (F, BW, VL, DQ, VNNI), else 256;
    0 without the native library. ``KILN_PANEL_ISA=256`` forces AVX2."""
    lib = library()
    return int(lib.kiln_panel_isa()) if lib is not None else 0


def set_panel_isa(bits: int) -> int:
    """Use the panel kernels of ``bits`` (256: AVX2, 512: AVX-512 where the CPU has it, 0: the best one);
    returns the width now in use (tests compare both)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native kernels are unavailable or disabled")
    return int(lib.kiln_set_panel_isa(int(bits)))


def set_native_kernels_enabled(enabled: bool) -> None:
    """Enable/disable the native kernels (disabled: the plain-torch path, for tests/debugging)."""
    global _enabled
    _enabled = bool(enabled)
    for lib in _opened:
        lib.kiln_ops_set_enabled(int(_enabled))


@contextlib.contextmanager
def native_kernels_disabled():
    """Force the plain-torch path inside the block (tests, debugging)."""
    old = _enabled
    set_native_kernels_enabled(False)
    try:
        yield
    finally:
        set_native_kernels_enabled(old)


# --------------------------------------------------------------------------------------------
# ops with a C++ CPU kernel
# --------------------------------------------------------------------------------------------


def _cpp_kernel_registered(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"kiln::{op}", "CPU")


def native_op_ready(op: str) -> bool:
    """True when the library is enabled and loaded (loading it on the first call) and the C++ CPU kernel
    of ``kiln::<op>`` is registered."""
    return library() is not None and _cpp_kernel_registered(op)


def define_native_op(lib: torch.library.Library, name: str, schema: str, impl: Callable, fake: Callable) -> None:
    """Define ``kiln::<name>`` (plain Library op: no custom_op wrapper per call) with a C++ CPU
    kernel from the native library and ``impl`` as the Python implementation.

    Two ops are defined with ``schema``: ``kiln::<name>`` and ``kiln::_<name>_py`` (``impl``). The
    C++ kernel of ``<name>`` (registered for CPU when the library loads) runs the cases it covers
    and calls ``_<name>_py`` for the rest. Until the library is loaded, and when it is disabled or
    unavailable, ``<name>``'s CompositeExplicitAutograd kernel runs: it loads the library and
    re-dispatches to the C++ kernel when that is registered, else runs ``impl``. ``fake`` is the
    shape function of both. (Plain Library ops rather than custom_op: a custom_op costs ~30-40 us
    of Python per call, which matters at batch-1 decode with hundreds of linears per step.)"""
    py_name = f"_{name}_py"
    lib.define(name + schema)
    lib.define(py_name + schema)

    def entry(*args):
        if args[0].device.type == "cpu" and native_op_ready(name):
            return getattr(torch.ops.kiln, name).default(*args)
        return impl(*args)

    lib.impl(name, entry, "CompositeExplicitAutograd")
    lib.impl(py_name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kiln::{name}", fake, lib=lib)
    torch.library.register_fake(f"kiln::{py_name}", fake, lib=lib)
