"""Fast CPU linear layers: weight-only int8 / int4 GEMMs and fp32 / bf16-weight linears.

Ops (all registered in the ``kiln`` namespace, with a fake kernel for ``torch.export``):

``kiln::weight_only_linear(x, qweight, scales, bias, bits, group_size, zeros=None) -> y``
    ``x`` [..., in] fp32 or bf16 (fp16 also accepted); ``y`` [..., out] in ``x``'s dtype.
    bits=8: ``qweight`` int8 [out, in], in panels [out/16, in/2, 16, 2] (``pack_panels``, what the
    builder stores) or in 8-row tiles [out/8, in/16, 8, 16] (``pack_rows``); ``scales`` fp32 [out]
    (per output channel; group_size ignored).
    bits=4: int4 panels (what the builder stores, and pre-quantized GPTQ / AWQ weights): ``qweight`` uint8
    [out/16, in/8, 64], ``scales`` fp16 [out/16, in//group_size, 16], ``zeros`` uint8 of the scales' shape or
    None (a zero point of 8: kiln's symmetric int4); or the older plain layout, ``qweight`` uint8 [out, in//2],
    ``scales`` fp32 [out, in//group_size] (no zeros).
``kiln::bf16_linear(x, weight, bias) -> y``
    ``weight`` bf16 [out, in], in panels [out/16, in/2, 16, 2] or in 8-row tiles; ``y`` in ``x``'s
    dtype; accumulation in fp32.
``kiln::fp32_linear(x, weight, bias) -> y``
    ``weight`` fp32 [out, in], in panels [out/16, in, 16] or in 8-row tiles: ``F.linear`` through
    kiln's kernels; :func:`kernel_max_m` sends larger M to torch for the non-panel layouts.

The weight formats (quantisation, int4 nibbles, panels, 8-row tiles) are :mod:`kiln.plugins.weight_format`.

Panels (``csrc/panel_kernels.h``): one register-blocked kernel per weight type serves every M, decode
and prefill, in one call: each panel is a sequential stream of 16 outputs' weights per k, multiplied by
broadcast elements of MR rows of x (AVX-512: 12 rows x 2 panels; AVX2: 6 x 1). int8 weights run in
integers (x quantised on the fly to int16 with one scale per row: error <= max|x_row|/65534, orders of
magnitude below the weight quantisation error; a call whose x holds NaN/inf computes in fp32, so they
propagate as in the reference; one row of x, i.e. decode, reads one sequential stream per thread);
int4 panels the same way, each group's int32 sum exact (started at -zero * the group's sum of x) before its scale;
bf16 weights with bf16 x use the CPU's bf16 dot product where it has one
(AVX512_BF16: products exact, fp32 accumulation), else they are widened to fp32; from :func:`bf16_gemm_m` rows
(on AMX CPUs) bf16 panels with bf16 x run as AMX GEMMs on the panels in place instead, int8 panels with fp32 x
from 64 rows on the tiles with x split into bf16 halves, and fp32 panels (only when asked: :func:`fp32_gemm_m`) with
x and the weights split so. The vector width is
chosen at run time (:func:`kiln.plugins.native.panel_isa`): the library runs on any AVX2 CPU.

Other layouts: small M (decode) runs streaming GEMV kernels (each weight byte read once per call,
nothing dequantised in memory, passes of up to 4 rows); M > 64 runs on 64-row chunks; above
:func:`kernel_max_m` (bf16: 64) the weight is dequantised in row chunks for torch's sgemm (the Python
implementations below). Kernels: C++ (``csrc/linear_kernels.cpp``; dispatcher glue in
``csrc/linear_ops.cpp``), in the native library (:mod:`kiln.plugins.native`); the ops' CPU kernels run
in C++ with no Python per call. Without the native library the plain-torch references run.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kiln.plugins import native
from kiln.plugins.native import ABI, define_native_op
from kiln.plugins.weight_format import (
    can_pack_int4_panels,
    check_int4_group,
    dequantize,
    is_int4_panel,
    is_packed,
    is_panel,
    qweight_shape,
    unpack,
    weight_shape,
)

__all__ = [
    "weight_only_linear", "bf16_linear", "fp32_linear",
    "weight_only_linear_reference", "bf16_linear_reference", "fp32_linear_reference", "float_linear_reference",
    "kernel_max_m", "set_kernel_max_m", "int4_gemm_m", "set_int4_gemm_m", "int4_x_bits", "set_int4_x_bits",
    "bf16_gemm_m", "set_bf16_gemm_m", "fp32_gemm_m", "set_fp32_gemm_m",
]

# Rows of the weight dequantised at once in the sgemm path (bounded fp32 scratch).
_PREFILL_CHUNK_BYTES = 16 << 20


# --------------------------------------------------------------------------------------------
# references (plain torch, used by tests and as the fallback)
# --------------------------------------------------------------------------------------------


def weight_only_linear_reference(x, qweight, scales, bias, bits: int, group_size: int, zeros=None):
    w = dequantize(qweight, scales, bits, group_size, zeros)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def float_linear_reference(x, weight, bias):
    """fp32/bf16 weights (plain or packed): ``F.linear`` in fp32, cast to x's dtype (the reference of
    both float ops)."""
    weight = unpack(weight)
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


fp32_linear_reference = bf16_linear_reference = float_linear_reference


# --------------------------------------------------------------------------------------------
# dispatch limits (the table lives in C++, csrc/linear_ops.cpp)
# --------------------------------------------------------------------------------------------


def kernel_max_m(kind: str) -> int:
    """Largest M (rows of x) that weights of ``kind`` ('bf16', 'int8', 'int4', 'fp32', or a layout's name such
    as 'fp32_panel') run through the kernels; above it torch's sgemm runs (on weights dequantised in row
    chunks). Panel layouts: unlimited. 0 when the native kernels are unavailable."""
    lib = native.library()
    return int(lib.kiln_ops_max_m(ABI.weight_types[kind])) if lib is not None else 0


def set_kernel_max_m(kind: str, max_m: int) -> int:
    """Change :func:`kernel_max_m` for ``kind`` (on a CPU with AVX-512/AMX GEMMs, lower it); returns
    the previous value."""
    lib = native.library()
    if lib is None:
        raise RuntimeError("the native kernels are unavailable or disabled: there is no kernel limit to set")
    old = kernel_max_m(kind)
    lib.kiln_ops_set_max_m(ABI.weight_types[kind], int(max_m))
    return old


def _gemm_m(kind: str) -> int:
    lib = native.library()
    return int(getattr(lib, f"kiln_ops_{kind}_gemm_m")()) if lib is not None else 0


def _set_gemm_m(kind: str, m: int) -> int:
    """Set the oneDNN-route threshold of ``kind`` ('int4' or 'bf16'); returns the previous value."""
    lib = native.library()
    if lib is None:
        raise RuntimeError(f"the native kernels are unavailable or disabled: there is no {kind} GEMM threshold to set")
    if m < 0:
        raise ValueError(f"{kind}_gemm_m must be >= 0 (0 turns the oneDNN GEMM path off), got {m}")
    old = _gemm_m(kind)
    getattr(lib, f"kiln_ops_set_{kind}_gemm_m")(int(m))
    return old


def int4_gemm_m() -> int:
    """Rows of x from which an int4-panel weight runs as a bf16 GEMM (oneDNN; AMX where present) on the weight
    dequantized once per call instead of the int4 kernels; 0: never (the default where the CPU has no AMX-BF16).
    That path rounds x to bf16 (~2^-9 relative error, far below the int4 weight error)."""
    return _gemm_m("int4")


def set_int4_gemm_m(m: int) -> int:
    """Change :func:`int4_gemm_m` (0 turns the bf16 GEMM path off); returns the previous value."""
    return _set_gemm_m("int4", m)


def int4_x_bits() -> int:
    """How the int4-panel kernels round x: 16 (int16 with one scale per row: error <= max|x_row| / 65534, the
    default) or 8 (int8 with one scale per weight group, as llama.cpp's q8_0 activations: error <=
    max|x_group| / 254, ~18x below the int4 weights' own rounding, for half the dot products and half the
    nibble decode). ``KILN_INT4_X_BITS=8`` chooses 8 for a process; 0 when the native kernels are unavailable."""
    lib = native.library()
    return int(lib.kiln_int4_x_bits()) if lib is not None else 0


def set_int4_x_bits(bits: int) -> int:
    """Change :func:`int4_x_bits` (8 or 16) for every int4-panel call of this process; returns the previous value."""
    lib = native.library()
    if lib is None:
        raise RuntimeError("the native kernels are unavailable or disabled: there is no int4 kernel to set")
    if bits not in (8, 16):
        raise ValueError(f"int4_x_bits must be 8 or 16, got {bits}")
    old = int4_x_bits()
    lib.kiln_set_int4_x_bits(int(bits))
    return old


def bf16_gemm_m() -> int:
    """Rows of x from which a bf16-panel weight with bf16 x runs as an AMX GEMM on the panels as stored (each
    panel's 16 k-pairs are one AMX B tile, each panel the VNNI-packed operand of a 16-column GEMM: no copy):
    kiln's AMX tile kernel where K is a multiple of 32, else torch's oneDNN brgemm per panel, instead of kiln's
    panel kernels; 0: never (the default where the CPU has no AMX-BF16; 5 where it has). Same numerics: exact
    products, fp32 sums. int8 panels with bf16 x take the tile kernel from this row count but never below 24 (K a
    multiple of 32): each panel pair converted to bf16, exact for int8, and the per-output scale applied to the fp32
    sums; below 24 rows the conversion costs more than the int8 kernels. int8 panels with fp32 x take the tiles from
    64 rows (and this count), x split into bf16 halves (hi_x w + lo_x w: x kept to ~16 significant bits, closer to
    the exact product than the int8 kernels' int16 rounding of x); 0 turns that route off too."""
    return _gemm_m("bf16")


def set_bf16_gemm_m(m: int) -> int:
    """Change :func:`bf16_gemm_m` (0 turns the oneDNN path off); returns the previous value. A CPU without
    AMX-BF16 refuses m > 0: torch's brgemm takes bf16 VNNI operands only through oneDNN's AMX ukernel."""
    old = bf16_gemm_m()
    _set_gemm_m("bf16", m)
    if m > 0 and bf16_gemm_m() != m:
        raise RuntimeError(
            f"bf16_gemm_m={m} needs a CPU with AMX-BF16 (torch's oneDNN brgemm takes bf16 panels only there); "
            "this CPU has none, so bf16 panels keep kiln's panel kernels: leave bf16_gemm_m at 0")
    return old


def fp32_gemm_m() -> int:
    """Rows of x from which an fp32-panel weight with fp32 x runs on AMX tiles with both operands split into bf16
    halves (x w ~ hi_x hi_w + hi_x lo_w + lo_x hi_w: three exact bf16 products summed in fp32, each operand kept to
    ~16 significant bits, PyTorch's "high" float32 matmul precision) instead of the fp32 panel kernels (exact fp32
    products); 0: never, the default. Prefill GEMMs run faster that way and fp32 logits land further from the exact
    ones (docs/benchmarks.md, session 27), so it is a choice: ``KILN_FP32_MATMUL=high`` when the process starts (64
    rows, where the CPU has AMX-BF16 and the OS grants tile state), or :func:`set_fp32_gemm_m`. A call whose x holds
    inf or NaN runs the fp32 kernels."""
    lib = native.library()
    return int(lib.kiln_ops_fp32_gemm_m()) if lib is not None else 0


def set_fp32_gemm_m(m: int) -> int:
    """Change :func:`fp32_gemm_m` (0: the fp32 panel kernels at every M); returns the previous value. A CPU without
    AMX tiles refuses m > 0."""
    lib = native.library()
    if lib is None:
        raise RuntimeError("the native kernels are unavailable or disabled: there is no fp32 GEMM threshold to set")
    if m < 0:
        raise ValueError(f"fp32_gemm_m must be >= 0 (0 turns the split-bf16 AMX path off), got {m}")
    old = fp32_gemm_m()
    if not lib.kiln_ops_set_fp32_gemm_m(int(m)):
        raise RuntimeError(f"fp32_gemm_m={m} needs a CPU with AMX-BF16 whose OS grants tile state; this one has "
                           "none, so fp32 panels keep kiln's fp32 kernels: leave fp32_gemm_m at 0")
    return old


def _native(wtype: str, x: torch.Tensor, w: torch.Tensor, scales, bias, group_size: int, n: int, k: int):
    """Run the native kernels for weight type ``wtype`` (a name of ``ABI.weight_types``); returns None
    when they are unavailable or do not cover the case (caller falls back)."""
    lib = native.library()
    if lib is None:
        return None
    wt = ABI.weight_types[wtype]
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
    if m == 0:
        y = x2.new_empty(0, n)
    elif m <= lib.kiln_ops_max_m(wt):
        y = torch.empty(m, n, dtype=torch.float32)
        xp, yp = x2.data_ptr(), y.data_ptr()
        step = m if wtype.endswith("_panel") else ABI.max_m  # the panel kernels take any M
        for m0 in range(0, m, step):
            mc = min(step, m - m0)
            rc = lib.kiln_linear(wt, w.data_ptr(), sp, group_size, xp + 4 * m0 * k, mc, n, k, bp,
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
            rc = lib.kiln_dequant_rows(wt, w.data_ptr(), sp, group_size, n, k, n0, n1, wc.data_ptr(), nthreads)
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


def _check_int4_panels(qweight, scales, zeros, group_size) -> None:
    n, k = qweight_shape(qweight, 4)
    if not can_pack_int4_panels(n, k, group_size):
        raise ValueError(f"bits=4 int4 panels [{qweight.shape[0]}, {qweight.shape[1]}, 64] ({n} x {k}) need a "
                         f"group_size that is a multiple of 8 dividing {k}, got {group_size}")
    want = (qweight.shape[0], k // group_size, 16)
    if scales.dtype != torch.float16 or tuple(scales.shape) != want:
        raise ValueError(f"bits=4 int4 panels expect float16 scales {list(want)}, got {scales.dtype} "
                         f"{list(scales.shape)}")
    if zeros is not None and (zeros.dtype != torch.uint8 or tuple(zeros.shape) != want):
        raise ValueError(f"bits=4 int4 panels expect uint8 zeros {list(want)} (or none), got {zeros.dtype} "
                         f"{list(zeros.shape)}")


def _check_bias(op: str, bias, n: int) -> None:
    """ValueError unless ``bias`` is None or one value per output feature (the kernels read n of them)."""
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{op}: bias {tuple(bias.shape)} must be [{n}], one value per output feature")


def _check_wol(x, qweight, scales, bias, bits, group_size, zeros=None):
    if zeros is not None and not (bits == 4 and is_int4_panel(qweight)):
        raise ValueError("zeros (zero points) are only taken by int4 panels (bits=4, qweight [out/16, in/8, 64])")
    if bits == 4 and is_int4_panel(qweight):
        _check_int4_panels(qweight, scales, zeros, group_size)
    elif bits == 8:
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
        check_int4_group(k, group_size)
        if scales.shape != (qweight.shape[0], k // group_size):
            raise ValueError(
                f"bits=4 expects scales [{qweight.shape[0]}, {k // group_size}], got {tuple(scales.shape)}"
            )
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n, k = qweight_shape(qweight, bits)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight expects {k}")
    _check_bias("weight_only_linear", bias, n)


def _weight_only_linear_py(x, qweight, scales, bias, bits, group_size, zeros=None):
    _check_wol(x, qweight, scales, bias, bits, group_size, zeros)
    if bits == 4 and is_int4_panel(qweight):   # the C++ kernel declined (NaN/inf in x, kernels off): reference
        return weight_only_linear_reference(x, qweight, scales, bias, 4, group_size, zeros)
    n, k = qweight_shape(qweight, bits)
    if bits == 8:
        wtype = "int8_panel" if is_panel(qweight) else "int8_packed" if is_packed(qweight) else "int8"
    else:
        wtype = "int4"
    y = _native(wtype, x, qweight, scales, bias, group_size if bits == 4 else 0, n, k)
    if y is None:
        y = weight_only_linear_reference(x, qweight, scales, bias, bits, group_size)
    return y


def _float_linear_py(kind: str, x, weight, bias):
    """fp32_linear / bf16_linear in Python: kiln's kernels where they apply, else the reference.
    fp32 weights above kernel_max_m go straight to torch's sgemm (nothing to dequantise)."""
    n, k = weight_shape(weight)
    if x.shape[-1] != k:
        raise ValueError(f"{kind}_linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} "
                         f"({k} input features)")
    _check_bias(f"{kind}_linear", bias, n)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    if is_panel(weight):  # the kernels read fp32 panels one k per step, bf16 panels in pairs of k
        wtype = f"{kind}_panel" if weight.dim() == (3 if kind == "fp32" else 4) else None
    else:
        wtype = f"{kind}_packed" if is_packed(weight) else kind
    y = None
    m = x.numel() // max(1, x.shape[-1])
    if wtype and weight.dtype == dtype and (kind != "fp32" or m <= kernel_max_m(wtype)):
        y = _native(wtype, x, weight, None, bias, 0, n, k)
    return y if y is not None else float_linear_reference(x, weight, bias)


# The C++ kernels (csrc/linear_ops.cpp) call the *_py ops for what they do not cover: those validate
# the arguments (clear ValueErrors) and run the large-M path (dequantised chunks + torch sgemm) or the
# plain-torch fallback.
_lib_def = torch.library.Library("kiln", "FRAGMENT")
define_native_op(_lib_def, "weight_only_linear",
                 "(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int bits, int group_size, "
                 "Tensor? zeros=None) -> Tensor",
                 _weight_only_linear_py,
                 lambda x, qweight, scales, bias, bits, group_size, zeros=None:
                 x.new_empty(*x.shape[:-1], qweight_shape(qweight, bits)[0]))
for _kind in ("bf16", "fp32"):
    define_native_op(_lib_def, f"{_kind}_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
                     functools.partial(_float_linear_py, _kind),
                     lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight_shape(weight)[0]))


def weight_only_linear(x, qweight, scales, bias=None, bits: int = 8, group_size: int = 0, zeros=None):
    """Python entry point: ``torch.ops.kiln.weight_only_linear``."""
    return torch.ops.kiln.weight_only_linear(x, qweight, scales, bias, bits, group_size, zeros)


def bf16_linear(x, weight, bias=None):
    """Python entry point: ``torch.ops.kiln.bf16_linear``."""
    return torch.ops.kiln.bf16_linear(x, weight, bias)


def fp32_linear(x, weight, bias=None):
    """Python entry point: ``torch.ops.kiln.fp32_linear``."""
    return torch.ops.kiln.fp32_linear(x, weight, bias)
