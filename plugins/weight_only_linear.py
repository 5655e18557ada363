"""Fast CPU linear layers: weight-only int8 / int4 GEMMs and a bf16-weight linear.

Ops (all registered in the ``kiln`` namespace, with a fake kernel for ``torch.export``):

``kiln::weight_only_linear(x, qweight, scales, bias, bits, group_size) -> y``
    ``x`` [..., in] fp32 or bf16 (fp16 also accepted); ``y`` [..., out] in ``x``'s dtype.
    bits=8: ``qweight`` int8 [out, in] or packed [out/8, in/16, 8, 16] (:func:`pack_rows`), ``scales``
    fp32 [out] (per output channel; group_size ignored).
    bits=4: ``qweight`` uint8 [out, in//2] in kiln's packed layout, ``scales`` fp32
    [out, in//group_size].
``kiln::bf16_linear(x, weight, bias) -> y``
    ``weight`` bf16 [out, in], or packed [out/8, in/16, 8, 16] (:func:`pack_rows`: tiles of 8 rows
    stored so that a GEMV tile is one sequential stream; the builder packs the engine's weights);
    ``y`` in ``x``'s dtype; accumulation in fp32.
``kiln::fp32_linear(x, weight, bias) -> y``
    ``weight`` fp32 [out, in] or packed as for bf16: ``F.linear`` through kiln's kernels (torch's
    fp32 GEMV reads one weight stream per core and reaches ~70% of the bandwidth on the project's
    AVX2 machine, and its sgemm is slow at small M there); ``KERNEL_MAX_M['fp32']`` sends larger M
    to torch.

Quantisation helpers: :func:`quantize_int8`, :func:`quantize_int4`, :func:`dequantize`,
:func:`pack_int4`, :func:`unpack_int4`.

int4 format: symmetric, values -8..7 (two's-complement nibbles), one fp32 scale per group of
``group_size`` consecutive input elements. As in llama.cpp's Q4_0, the scale is chosen so that the
element of largest magnitude maps exactly to -8 (the scale may therefore be negative); the full
16-level range is used. Packed layout of a row: the input dim is cut in blocks of 64 elements
stored in 32 bytes; the little-endian 16-bit word ``l`` (0..15) of a block holds element
``64*b + 16*j + l`` in its nibble ``j`` (bits 4j..4j+3). A trailing partial block (in % 64 != 0)
is stored plainly: element 2i in the low nibble of byte i, 2i+1 in the high nibble. The layout
lets the AVX2 kernel expand 16 consecutive weights with one load and two 16-bit shifts.

Activations: the int8/int4 kernels quantise x on the fly to int16 with one scale per row (error
<= max|x_row|/65534, orders of magnitude below the weight quantisation error; outputs match the
dequantise+F.linear reference to ~1e-5 relative) and compute the dot products with integer
multiply-adds, which is twice as fast as int->float conversion + FMA on AVX2 (a call whose x
holds NaN/inf computes in fp32 instead, so they propagate as in the reference). bf16 weights
are widened to fp32 (exact) and accumulated in fp32. bf16 activations are widened, and the outputs
rounded to bf16 (as torch rounds), inside the kernel call.

Kernels: C++ (AVX2 + FMA + OpenMP, ``plugins/csrc/weight_only_linear.cpp``; dispatcher glue in
``plugins/csrc/linear_ops.cpp``) compiled with ``torch.utils.cpp_extension.load`` on first use
(~10-20 s cold) and cached in TORCH_EXTENSIONS_DIR; from then on the ops' CPU kernels run in C++
with no Python per call. Dispatch on M (rows of ``x``): small M (decode) runs streaming GEMV
kernels (each weight byte is read once per call, nothing is dequantised in memory, all M rows
computed from one pass over the weights for M <= 4, passes of 4 rows above); M > 64 runs on
64-row chunks; above ``KERNEL_MAX_M`` (bf16: 64) the weight is dequantised in row chunks for
torch's sgemm. Set ``KILN_DISABLE_NATIVE_KERNELS=1`` (or call
:func:`set_native_kernels_enabled(False)`) to force the plain-torch path; if the compile fails or
the CPU lacks AVX2/FMA, the torch path is used after a one-time warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "quantize_int8",
    "quantize_int4",
    "dequantize",
    "pack_int4",
    "unpack_int4",
    "weight_only_linear",
    "bf16_linear",
    "weight_only_linear_reference",
    "bf16_linear_reference",
    "fp32_linear",
    "fp32_linear_reference",
    "pack_rows",
    "unpack_rows",
    "can_pack_rows",
    "is_packed",
    "native_kernels_available",
    "set_native_kernels_enabled",
    "native_kernels_disabled",
    "set_kernel_max_m",
    "stream_read_bandwidth",
    "stream_read_rate",
    "KERNEL_MAX_M",
]

# Dispatch on M (rows of x). Measured on the project's AVX2 machine (AMD Zen 1, 2 cores), where
# torch's sgemm reaches 19-68 GFLOP/s depending on the shape (19 at M=16 with K=1024): the native
# kernels (50-70 GFLOP/s) win for fp32 weights at every M on the whole model (a 256-token prefill
# of the 311M Llama: 2.32 s vs 2.43 s through sgemm), bf16 up to M ~ 64-128 and int8/int4 at every M
# tried (up to 256). Above the limit: torch sgemm (bf16/int weights dequantised in row chunks). On a
# CPU with AVX-512/AMX GEMMs, lower these (set_kernel_max_m).
KERNEL_MAX_M = {"bf16": 64, "int8": 1 << 30, "int4": 1 << 30, "fp32": 1 << 30}
_KERNEL_CHUNK_M = 64  # the C kernels take at most 64 rows per call; bigger M is split
# Rows of the weight dequantised at once in the sgemm path (bounded fp32 scratch).
_PREFILL_CHUNK_BYTES = 16 << 20

_WTYPE_BF16, _WTYPE_INT8, _WTYPE_INT4, _WTYPE_F32 = 0, 1, 2, 3
_WTYPE_BF16_PACKED, _WTYPE_F32_PACKED, _WTYPE_INT8_PACKED = 4, 5, 6
_KINDS = ("bf16", "int8", "int4", "fp32")  # index = the C side's kind (weight type without layout)
_KIND_OF_WTYPE = _KINDS + ("bf16", "fp32", "int8")
_ABI_VERSION = 8

# --------------------------------------------------------------------------------------------
# quantisation and the int4 layout (plain torch)
# --------------------------------------------------------------------------------------------


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``w[out, in] ~= q[out, in] * scales[out, None]``.

    q in [-127, 127]; |w - q*s| <= s/2 with s = max|w_row| / 127. All-zero rows get scale 1.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 expects a 2-D weight [out, in], got shape {tuple(w.shape)}")
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(wf / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def _int4_group_check(in_features: int, group_size: int) -> None:
    if group_size <= 0:
        raise ValueError(f"int4 group_size must be positive, got {group_size}")
    if in_features % group_size != 0:
        raise ValueError(
            f"int4 quantization needs the input dim ({in_features}) to be a multiple of "
            f"group_size ({group_size}); choose a group_size that divides {in_features} "
            f"(e.g. 32, 64 or 128 for usual hidden sizes)"
        )
    if in_features % 2 != 0:
        raise ValueError(f"int4 quantization needs an even input dim, got {in_features}")


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise int4 (values -8..7), packed in kiln's layout (see module doc).

    Returns ``(packed uint8 [out, in//2], scales fp32 [out, in//group_size])``. Per group the
    element of largest magnitude maps exactly to -8; the error of any element is <= |scale|
    (<= |scale|/2 except for elements of the opposite sign near the max, which clamp to 7).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_int4 expects a 2-D weight [out, in], got shape {tuple(w.shape)}")
    n, k = w.shape
    _int4_group_check(k, group_size)
    wg = w.detach().float().reshape(n, k // group_size, group_size)
    idx = wg.abs().argmax(dim=2, keepdim=True)
    mx = torch.gather(wg, 2, idx).squeeze(2)  # signed value of largest magnitude
    scales = torch.where(mx != 0, mx / -8.0, torch.ones_like(mx))
    q = torch.round(wg / scales[..., None]).clamp_(-8, 7).to(torch.int8).reshape(n, k)
    return pack_int4(q), scales.contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], shape [out, in] (in even) -> packed uint8 [out, in//2] (kiln layout)."""
    n, k = q.shape
    if k % 2:
        raise ValueError(f"pack_int4 needs an even input dim, got {k}")
    nib = (q.to(torch.int16) & 0xF).to(torch.uint8)
    kb = (k // 64) * 64
    parts = []
    if kb:
        # [n, blocks, j, l] -> [n, blocks, l, j]; byte 2l + j//2, low nibble = even j
        blk = nib[:, :kb].reshape(n, kb // 64, 4, 16).transpose(2, 3).reshape(n, kb // 64, 16, 2, 2)
        parts.append((blk[..., 0] | (blk[..., 1] << 4)).reshape(n, kb // 2))
    if k > kb:
        tail = nib[:, kb:].reshape(n, (k - kb) // 2, 2)
        parts.append(tail[..., 0] | (tail[..., 1] << 4))
    return torch.cat(parts, dim=1).contiguous() if len(parts) > 1 else parts[0].contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 [out, in//2] -> int8 [out, in] in [-8, 7]."""
    n, kh = packed.shape
    k = 2 * kh
    p = packed.to(torch.int16)
    lo = p & 0xF
    hi = (p >> 4) & 0xF
    vals = torch.stack([lo, hi], dim=-1)  # [n, kh, 2]
    vals = torch.where(vals >= 8, vals - 16, vals).to(torch.int8)
    kb = (k // 64) * 64
    parts = []
    if kb:
        blk = vals[:, : kb // 2].reshape(n, kb // 64, 16, 4)  # [n, blocks, l, j]
        parts.append(blk.transpose(2, 3).reshape(n, kb))
    if k > kb:
        parts.append(vals[:, kb // 2 :].reshape(n, k - kb))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()


ROW_TILE, K_STEP = 8, 16  # packed float weights: tiles of 8 rows, 16 input elements per step


def can_pack_rows(weight: torch.Tensor) -> bool:
    """True if a 2-D [out, in] weight fits the packed layout (out % 8 == 0, in % 16 == 0)."""
    return weight.dim() == 2 and weight.shape[0] % ROW_TILE == 0 and weight.shape[1] % K_STEP == 0


def is_packed(weight: torch.Tensor) -> bool:
    return weight.dim() == 4 and tuple(weight.shape[2:]) == (ROW_TILE, K_STEP)


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out/8, in/16, 8, 16]: element (n, k) at [n//8, k//16, n%8, k%16].

    The 8 rows that a GEMV tile reads together then lie in one contiguous block per 16 input
    elements, so a tile is one sequential stream (see weight_only_linear.cpp, WFloat)."""
    if not can_pack_rows(weight):
        raise ValueError(
            f"pack_rows needs a 2-D weight with out % {ROW_TILE} == 0 and in % {K_STEP} == 0, "
            f"got shape {tuple(weight.shape)}"
        )
    n, k = weight.shape
    return weight.reshape(n // ROW_TILE, ROW_TILE, k // K_STEP, K_STEP).permute(0, 2, 1, 3).contiguous()


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: [out/8, in/16, 8, 16] -> [out, in]."""
    a, b = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(a * ROW_TILE, b * K_STEP)


def weight_shape(weight: torch.Tensor) -> tuple[int, int]:
    """(out, in) of a plain [out, in] or packed [out/8, in/16, 8, 16] weight (fp32, bf16 or int8)."""
    if is_packed(weight):
        return weight.shape[0] * ROW_TILE, weight.shape[1] * K_STEP
    if weight.dim() != 2:
        raise ValueError(
            f"expected a weight [out, in] or packed [out/{ROW_TILE}, in/{K_STEP}, {ROW_TILE}, {K_STEP}], "
            f"got shape {tuple(weight.shape)}"
        )
    return weight.shape[0], weight.shape[1]


def _qweight_shape(qweight: torch.Tensor, bits: int) -> tuple[int, int]:
    """(out, in) of a quantised weight: int8 plain or packed, int4 [out, in//2]."""
    if bits == 8:
        return weight_shape(qweight)
    return qweight.shape[0], 2 * qweight.shape[1]


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """fp32 [out, in] weight that the quantised form stands for."""
    if bits == 8:
        q = unpack_rows(qweight) if is_packed(qweight) else qweight
        return q.float() * scales.float()[:, None]
    if bits == 4:
        q = unpack_int4(qweight).float()
        n, k = q.shape
        _int4_group_check(k, group_size)
        return (q.reshape(n, k // group_size, group_size) * scales.float()[..., None]).reshape(n, k)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


# --------------------------------------------------------------------------------------------
# references (plain torch, used by tests and as the fallback)
# --------------------------------------------------------------------------------------------


def weight_only_linear_reference(x, qweight, scales, bias, bits: int, group_size: int):
    w = dequantize(qweight, scales, bits, group_size)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def float_linear_reference(x, weight, bias):
    """fp32/bf16 weights (plain or packed): ``F.linear`` in fp32, cast to x's dtype (the reference of
    both float ops)."""
    if is_packed(weight):
        weight = unpack_rows(weight)
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


fp32_linear_reference = bf16_linear_reference = float_linear_reference


# --------------------------------------------------------------------------------------------
# native library: lazy compile + ctypes
# --------------------------------------------------------------------------------------------

_CSRC_DIR = Path(__file__).resolve().parent / "csrc"
# plugin_ops.cpp: the CPU kernels of the norm / rotary / activation / paged attention ops (same library)
_SOURCES = [_CSRC_DIR / "weight_only_linear.cpp", _CSRC_DIR / "linear_ops.cpp", _CSRC_DIR / "plugin_ops.cpp"]
_lib_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_state = "unloaded"  # unloaded | ok | failed
_enabled = os.environ.get("KILN_DISABLE_NATIVE_KERNELS", "0") in ("", "0", "false", "False")
_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _cpu_has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _load_library() -> Optional[ctypes.CDLL]:
    global _lib, _lib_state
    if _lib_state == "ok":
        return _lib
    if _lib_state == "failed":
        return None
    with _lib_lock:
        if _lib_state != "unloaded":
            return _lib
        try:
            if not _cpu_has_avx2_fma():
                raise RuntimeError("this CPU lacks AVX2/FMA")
            from torch.utils import cpp_extension

            path = cpp_extension.load(
                name=f"kiln_linear_kernels_v{_ABI_VERSION}",
                sources=[str(p) for p in _SOURCES],
                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            lib = ctypes.CDLL(path)
            if lib.kiln_wol_abi_version() != _ABI_VERSION:
                raise RuntimeError("stale kernel library (ABI version mismatch)")
            i64, vp, fp = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p
            lib.kiln_linear.argtypes = [ctypes.c_int, vp, fp, i64, fp, i64, i64, i64, fp, fp, ctypes.c_int, ctypes.c_int]
            lib.kiln_linear.restype = ctypes.c_int
            lib.kiln_dequant_rows.argtypes = [ctypes.c_int, vp, fp, i64, i64, i64, i64, i64, fp, ctypes.c_int]
            lib.kiln_dequant_rows.restype = ctypes.c_int
            lib.kiln_stream_sum.argtypes = [fp, i64, ctypes.c_int]
            lib.kiln_stream_sum.restype = ctypes.c_double
            lib.kiln_ops_set_enabled.argtypes = [ctypes.c_int]
            lib.kiln_ops_set_max_m.argtypes = [ctypes.c_int, i64]
            lib.kiln_ops_set_enabled(int(_enabled))
            for wtype, kind in enumerate(_KINDS):
                lib.kiln_ops_set_max_m(wtype, min(KERNEL_MAX_M[kind], 1 << 40))
            _lib = lib
            _lib_state = "ok"
        except Exception as e:  # compile error, missing compiler, no AVX2 ...
            _lib_state = "failed"
            _warn_once(
                "load",
                f"kiln: native linear kernels unavailable ({type(e).__name__}: {str(e)[:500]}); "
                "using the slower plain-torch path",
            )
        return _lib


def native_kernels_available() -> bool:
    """True if the native kernels are enabled and compiled (compiles them on first call)."""
    return _enabled and _load_library() is not None


def set_native_kernels_enabled(enabled: bool) -> None:
    """Enable/disable the native kernels (disabled: the plain-torch path, for tests/debugging)."""
    global _enabled
    _enabled = bool(enabled)
    if _lib is not None:
        _lib.kiln_ops_set_enabled(int(_enabled))


def stream_read_bandwidth(nbytes: int = 64 << 20, repeats: int = 7, threads: Optional[int] = None) -> float:
    """Best-of-``repeats`` GB/s of a pure streaming read of ``nbytes`` with ``threads`` threads
    (default: torch's), the bound a batch-1 decode GEMV is compared with (weights bytes / GB/s).
    Uses the native read kernel (falls back to ``torch.sum``, which reads slower)."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    stream_read_rate(buf, threads)
    return max(stream_read_rate(buf, threads) for _ in range(repeats))


def stream_read_rate(buf: torch.Tensor, threads: Optional[int] = None) -> float:
    """GB/s of one streaming read of the fp32 tensor ``buf`` (benchmarks interleave these reads with
    the steps they measure, so that both see the same share of a shared machine's memory bus)."""
    import time

    nt = threads or torch.get_num_threads()
    lib = _load_library() if _enabled else None
    t0 = time.perf_counter()
    if lib is not None:
        lib.kiln_stream_sum(buf.data_ptr(), buf.numel(), nt)
    else:
        float(buf.sum())
    return buf.numel() * 4 / (time.perf_counter() - t0) / 1e9


def set_kernel_max_m(kind: str, max_m: int) -> int:
    """Largest M that ``kind`` ('bf16', 'int8', 'int4', 'fp32') runs through the kernels; above it
    torch's sgemm runs (on weights dequantised in row chunks). Returns the previous value."""
    old = KERNEL_MAX_M[kind]
    KERNEL_MAX_M[kind] = int(max_m)
    if _lib is not None:
        _lib.kiln_ops_set_max_m(_KINDS.index(kind), min(int(max_m), 1 << 40))
    return old


@contextlib.contextmanager
def native_kernels_disabled():
    """Force the plain-torch path inside the block (tests, debugging)."""
    old = _enabled
    set_native_kernels_enabled(False)
    try:
        yield
    finally:
        set_native_kernels_enabled(old)


def _native(wtype: int, x: torch.Tensor, w: torch.Tensor, scales, bias, group_size: int, n: int, k: int):
    """Run the native kernel; returns None when the case is not covered (caller falls back)."""
    if not _enabled:
        return None
    lib = _load_library()
    if lib is None:
        return None
    out_dtype = x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    x2 = x2.contiguous()
    m = x2.shape[0]
    if not w.is_contiguous():
        w = w.contiguous()
    sp = None
    if scales is not None:
        if scales.dtype != torch.float32 or not scales.is_contiguous():
            scales = scales.float().contiguous()
        sp = scales.data_ptr()
    bp = None
    if bias is not None:
        if bias.dtype != torch.float32 or not bias.is_contiguous():
            bias = bias.float().contiguous()
        bp = bias.data_ptr()
    nthreads = torch.get_num_threads()
    kind = _KIND_OF_WTYPE[wtype]
    if m == 0:
        y = x2.new_empty(0, n)
    elif m <= KERNEL_MAX_M[kind]:
        y = torch.empty(m, n, dtype=torch.float32)
        xp, yp, step = x2.data_ptr(), y.data_ptr(), _KERNEL_CHUNK_M
        for m0 in range(0, m, step):
            mc = min(step, m - m0)
            rc = lib.kiln_linear(wtype, w.data_ptr(), sp, group_size, xp + 4 * m0 * k, mc, n, k, bp,
                                 yp + 4 * m0 * n, nthreads, 0)
            if rc != 0:
                return None
    else:
        y = torch.empty(m, n, dtype=torch.float32)
        rows = max(1, min(n, _PREFILL_CHUNK_BYTES // (4 * k)))
        wbuf = torch.empty(rows, k, dtype=torch.float32)
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            wc = wbuf[: n1 - n0]
            rc = lib.kiln_dequant_rows(wtype, w.data_ptr(), sp, group_size, n, k, n0, n1, wc.data_ptr(), nthreads)
            if rc != 0:
                return None
            if n0 == 0 and n1 == n:
                torch.mm(x2, wc.t(), out=y)
            else:
                y[:, n0:n1] = torch.mm(x2, wc.t())
        if bias is not None:
            y += bias
    if out_dtype != torch.float32:
        y = y.to(out_dtype)
    return y.reshape(*lead, n)


# --------------------------------------------------------------------------------------------
# ops
# --------------------------------------------------------------------------------------------


def _check_wol(x, qweight, scales, bias, bits, group_size):
    if bits == 8:
        if qweight.dtype != torch.int8:
            raise ValueError(f"bits=8 expects an int8 qweight, got {qweight.dtype}")
        n = weight_shape(qweight)[0]  # raises on a shape that is neither [out, in] nor packed
        if scales.shape != (n,):
            raise ValueError(f"bits=8 expects scales [{n}], got {tuple(scales.shape)}")
    elif bits == 4:
        if qweight.dtype != torch.uint8 or qweight.dim() != 2:
            raise ValueError(f"bits=4 expects a packed uint8 qweight [out, in//2], got {qweight.dtype} "
                             f"{tuple(qweight.shape)}")
        k = 2 * qweight.shape[1]
        _int4_group_check(k, group_size)
        if scales.shape != (qweight.shape[0], k // group_size):
            raise ValueError(
                f"bits=4 expects scales [{qweight.shape[0]}, {k // group_size}], got {tuple(scales.shape)}"
            )
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    k = _qweight_shape(qweight, bits)[1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight expects {k}")


def _weight_only_linear_py(x, qweight, scales, bias, bits, group_size):
    _check_wol(x, qweight, scales, bias, bits, group_size)
    n, k = _qweight_shape(qweight, bits)
    if bits == 8:
        wtype = _WTYPE_INT8_PACKED if is_packed(qweight) else _WTYPE_INT8
    else:
        wtype = _WTYPE_INT4
    y = _native(wtype, x, qweight, scales, bias, group_size if bits == 4 else 0, n, k)
    if y is None:
        y = weight_only_linear_reference(x, qweight, scales, bias, bits, group_size)
    return y


def _float_linear_py(kind: str, x, weight, bias):
    """fp32_linear / bf16_linear in Python: kiln's kernels where they apply, else the reference.
    fp32 weights above KERNEL_MAX_M go straight to torch's sgemm (nothing to dequantise)."""
    n, k = weight_shape(weight)
    if x.shape[-1] != k:
        raise ValueError(f"{kind}_linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} "
                         f"({k} input features)")
    packed = is_packed(weight)
    if kind == "fp32":
        dtype, wtype = torch.float32, (_WTYPE_F32_PACKED if packed else _WTYPE_F32)
    else:
        dtype, wtype = torch.bfloat16, (_WTYPE_BF16_PACKED if packed else _WTYPE_BF16)
    y = None
    m = x.numel() // max(1, x.shape[-1])
    if weight.dtype == dtype and (kind != "fp32" or m <= KERNEL_MAX_M["fp32"]):
        y = _native(wtype, x, weight, None, bias, 0, n, k)
    return y if y is not None else float_linear_reference(x, weight, bias)


def _cpp_kernel_registered(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"kiln::{op}", "CPU")


def native_op_ready(op: str) -> bool:
    """True when the native library is enabled and loaded (compiling it on first call) and the C++
    CPU kernel of ``kiln::<op>`` is registered. The other plugin modules share this loader: their
    Python kernels call it on the first call and re-dispatch to the C++ kernel from then on."""
    return _enabled and _load_library() is not None and _cpp_kernel_registered(op)


def define_native_op(lib: torch.library.Library, name: str, schema: str, impl, fake) -> None:
    """Define ``kiln::<name>`` (plain Library op: no custom_op wrapper per call) with a C++ CPU
    kernel from the native library and ``impl`` as the Python implementation.

    Two ops are defined with ``schema``: ``kiln::<name>`` and ``kiln::_<name>_py`` (``impl``). The
    C++ kernel of ``<name>`` (registered for CPU when the library loads) runs the cases it covers
    and calls ``_<name>_py`` for the rest. Until the library is loaded, and when it is disabled or
    unavailable, ``<name>``'s CompositeExplicitAutograd kernel runs: it loads the library and
    re-dispatches to the C++ kernel when that is registered, else runs ``impl``. ``fake`` is the
    shape function of both. (Plain Library ops rather than custom_op: a custom_op costs ~30-40 us
    of Python per call here, which matters at batch-1 decode with hundreds of linears per step.)"""
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


# The linear ops' C++ kernels live in plugins/csrc/linear_ops.cpp; the *_py ops validate the
# arguments (clear ValueErrors) and run the large-M path (dequantised chunks + torch sgemm) or the
# plain-torch fallback.
_lib_def = torch.library.Library("kiln", "FRAGMENT")
define_native_op(_lib_def, "weight_only_linear",
                 "(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int bits, int group_size) -> Tensor",
                 _weight_only_linear_py,
                 lambda x, qweight, scales, bias, bits, group_size: x.new_empty(*x.shape[:-1], _qweight_shape(qweight, bits)[0]))
for _kind in ("bf16", "fp32"):
    define_native_op(_lib_def, f"{_kind}_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
                     functools.partial(_float_linear_py, _kind),
                     lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight_shape(weight)[0]))


def weight_only_linear(x, qweight, scales, bias=None, bits: int = 8, group_size: int = 0):
    """Python entry point: ``torch.ops.kiln.weight_only_linear``."""
    return torch.ops.kiln.weight_only_linear(x, qweight, scales, bias, bits, group_size)


def bf16_linear(x, weight, bias=None):
    """Python entry point: ``torch.ops.kiln.bf16_linear``."""
    return torch.ops.kiln.bf16_linear(x, weight, bias)


def fp32_linear(x, weight, bias=None):
    """Python entry point: ``torch.ops.kiln.fp32_linear``."""
    return torch.ops.kiln.fp32_linear(x, weight, bias)
