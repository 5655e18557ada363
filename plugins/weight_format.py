"""The weight formats of kiln's linear ops: int8/int4 quantisation, the int4 nibble layout, 8-row tiles.

Plain torch (no native code); the builder stores weights in these formats and the kernels of
:mod:`kiln.plugins.linear` read them.

int8: symmetric, one fp32 scale per output channel, ``w[out, in] ~= q[out, in] * scales[out, None]``.

int4 format: symmetric, values -8..7 (two's-complement nibbles), one fp32 scale per group of
``group_size`` consecutive input elements. As in llama.cpp's Q4_0, the scale is chosen so that the
element of largest magnitude maps exactly to -8 (the scale may therefore be negative); the full
16-level range is used. Packed layout of a row: the input dim is cut in blocks of 64 elements
stored in 32 bytes; the little-endian 16-bit word ``l`` (0..15) of a block holds element
``64*b + 16*j + l`` in its nibble ``j`` (bits 4j..4j+3). A trailing partial block (in % 64 != 0)
is stored plainly: element 2i in the low nibble of byte i, 2i+1 in the high nibble. The layout
lets the AVX2 kernel expand 16 consecutive weights with one load and two 16-bit shifts.

Packed rows (fp32, bf16 and int8 weights): [out, in] -> [out/8, in/16, 8, 16], element (n, k) at
[n//8, k//16, n%8, k%16], so that the 8 rows a GEMV tile reads together lie in one contiguous block
per 16 input elements and a tile is one sequential stream (the tile shape is the C++ header's,
:data:`kiln.plugins.native.ABI`).

Panels (what the builder stores; the GEMM kernels' layout, ``csrc/panel_kernels.h``): 16 output rows per
panel, one sequential stream each, holding for every k the 16 rows' weights side by side, so that one
vector load feeds 16 outputs. fp32: [out, in] -> [out/16, in, 16], element (n, k) at [n//16, k, n%16];
bf16 and int8 keep pairs of consecutive k together: [out/16, in/2, 16, 2], element (n, k) at
[n//16, k//2, n%16, k%2] (one 32-bit lane holds a bf16 pair, or an int8 pair for a 16-bit
multiply-add).

int4 panels (what the builder stores for int4, and what pre-quantized GPTQ / AWQ checkpoints become):
``Int4Panels`` = (qweight uint8 [out/16, in/8, 64], scales fp16 [out/16, in/group_size, 16], zeros uint8
[out/16, in/group_size, 16] or None). Each 64-byte block holds 8 consecutive k of a panel's 16 rows: 16-bit
little-endian word i (0..31) holds in its nibble c (bits 4c..4c+3) the unsigned value u (0..15) of element
(n = i//2, k = 8*block + 2c + i%2), so one shift and mask per pair of k feed the kernels' 16-bit
multiply-adds. ``w = (u - zero) * scale``; no zeros means a zero point of 8 for every group (kiln's symmetric
int4, ``u = q + 8``). GPTQ and AWQ zero points (asymmetric) are kept as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kiln.plugins.native import ABI

__all__ = [
    "ROW_TILE", "K_STEP", "quantize_int8", "quantize_int4", "check_int4_group", "pack_int4", "unpack_int4",
    "can_pack_rows", "is_packed", "pack_rows", "unpack_rows", "weight_shape", "qweight_shape", "dequantize",
    "PANEL", "PAIR", "can_pack_panels", "is_panel", "pack_panels", "unpack_panels", "unpack",
    "INT4_BLOCK", "Int4Panels", "can_pack_int4_panels", "pack_int4_panels", "unpack_int4_panels",
    "quantize_int4_panels", "dequantize_int4_panels", "is_int4_panel",
]

ROW_TILE, K_STEP = ABI.row_tile, ABI.k_step  # packed weights: tiles of 8 rows, 16 input elements per step
PANEL, PAIR = ABI.panel, ABI.pair  # panels: 16 output rows; bf16/int8 interleave pairs of k
INT4_BLOCK = ABI.int4_block  # int4 panels: k per 64-byte block


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


def check_int4_group(in_features: int, group_size: int) -> None:
    """Raise a ValueError naming the fix when ``group_size`` cannot cut ``in_features`` into int4 groups."""
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
    check_int4_group(k, group_size)
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


def can_pack_rows(weight: torch.Tensor) -> bool:
    """True if a 2-D [out, in] weight fits the packed layout (out % 8 == 0, in % 16 == 0)."""
    return weight.dim() == 2 and weight.shape[0] % ROW_TILE == 0 and weight.shape[1] % K_STEP == 0


def is_packed(weight: torch.Tensor) -> bool:
    return weight.dim() == 4 and tuple(weight.shape[2:]) == (ROW_TILE, K_STEP)


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out/8, in/16, 8, 16]: element (n, k) at [n//8, k//16, n%8, k%16].

    The 8 rows that a GEMV tile reads together then lie in one contiguous block per 16 input
    elements, so a tile is one sequential stream (see csrc/linear_kernels.cpp, WFloat)."""
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


def _pairs(dtype: torch.dtype) -> bool:
    return dtype != torch.float32  # fp32 panels hold one k per step, bf16/int8 pairs


def can_pack_panels(weight: torch.Tensor) -> bool:
    """True if a 2-D [out, in] weight fits the panel layout (out % 16 == 0; in even for bf16 and int8)."""
    return (weight.dim() == 2 and weight.shape[0] % PANEL == 0 and weight.shape[0] > 0
            and (not _pairs(weight.dtype) or weight.shape[1] % PAIR == 0))


def is_panel(weight: torch.Tensor) -> bool:
    """[out/16, in, 16] or [out/16, in/2, 16, 2]: a weight in the panel layout."""
    return ((weight.dim() == 3 and weight.shape[2] == PANEL)
            or (weight.dim() == 4 and tuple(weight.shape[2:]) == (PANEL, PAIR)))


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the panel layout of its dtype (fp32 [out/16, in, 16]; bf16, int8 [out/16, in/2, 16, 2])."""
    if not can_pack_panels(weight):
        raise ValueError(f"pack_panels needs a 2-D weight with out % {PANEL} == 0 (and an even in for "
                         f"{weight.dtype}), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if _pairs(weight.dtype):
        return weight.reshape(n // PANEL, PANEL, k // PAIR, PAIR).permute(0, 2, 1, 3).contiguous()
    return weight.reshape(n // PANEL, PANEL, k).permute(0, 2, 1).contiguous()


def unpack_panels(panels: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_panels`: -> [out, in]."""
    if panels.dim() == 4:
        a, b = panels.shape[:2]
        return panels.permute(0, 2, 1, 3).reshape(a * PANEL, b * PAIR)
    return panels.permute(0, 2, 1).reshape(panels.shape[0] * PANEL, panels.shape[1])


def unpack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] of a weight in any layout (plain, 8-row tiles, panels)."""
    if is_panel(weight):
        return unpack_panels(weight)
    if is_packed(weight):
        return unpack_rows(weight)
    return weight


def weight_shape(weight: torch.Tensor) -> tuple[int, int]:
    """(out, in) of a plain [out, in], packed [out/8, in/16, 8, 16] or panel weight (fp32, bf16 or int8)."""
    if is_panel(weight):
        return weight.shape[0] * PANEL, weight.shape[1] * (PAIR if weight.dim() == 4 else 1)
    if is_packed(weight):
        return weight.shape[0] * ROW_TILE, weight.shape[1] * K_STEP
    if weight.dim() != 2:
        raise ValueError(
            f"expected a weight [out, in] or packed [out/{ROW_TILE}, in/{K_STEP}, {ROW_TILE}, {K_STEP}], "
            f"got shape {tuple(weight.shape)}"
        )
    return weight.shape[0], weight.shape[1]


def qweight_shape(qweight: torch.Tensor, bits: int) -> tuple[int, int]:
    """(out, in) of a quantised weight: int8 plain or packed, int4 [out, in//2] or int4 panels."""
    if bits == 8:
        return weight_shape(qweight)
    if is_int4_panel(qweight):
        return qweight.shape[0] * PANEL, qweight.shape[1] * INT4_BLOCK
    return qweight.shape[0], 2 * qweight.shape[1]


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
               zeros: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [out, in] weight that the quantised form stands for (``zeros``: int4 panels' zero points)."""
    if bits == 4 and is_int4_panel(qweight):
        return dequantize_int4_panels(Int4Panels(qweight, scales, zeros, group_size))
    if bits == 8:
        q = unpack(qweight)
        return q.float() * scales.float()[:, None]
    if bits == 4:
        q = unpack_int4(qweight).float()
        n, k = q.shape
        check_int4_group(k, group_size)
        return (q.reshape(n, k // group_size, group_size) * scales.float()[..., None]).reshape(n, k)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


# --------------------------------------------------------------------------------------------
# int4 panels
# --------------------------------------------------------------------------------------------


class Int4Panels(NamedTuple):
    """An int4 weight in the panel layout (module doc): what ``kiln::weight_only_linear`` takes for bits=4 with
    ``zeros`` (its last argument) and what the builder stores."""

    qweight: torch.Tensor          # uint8 [out/16, in/8, 64]
    scales: torch.Tensor           # float16 [out/16, in/group_size, 16]
    zeros: torch.Tensor | None     # uint8 [out/16, in/group_size, 16], or None: 8 everywhere
    group_size: int


def is_int4_panel(qweight: torch.Tensor) -> bool:
    return qweight.dtype == torch.uint8 and qweight.dim() == 3 and qweight.shape[2] == 64


def can_pack_int4_panels(out_features: int, in_features: int, group_size: int) -> bool:
    """True if the int4 panel layout takes this shape: out % 16 == 0, in % 8 == 0, group_size % 8 == 0 and
    dividing in."""
    return (out_features % PANEL == 0 and out_features > 0 and in_features % INT4_BLOCK == 0 and group_size > 0
            and group_size % INT4_BLOCK == 0 and in_features % group_size == 0)


def _check_int4_panels(n: int, k: int, group_size: int) -> None:
    if not can_pack_int4_panels(n, k, group_size):
        raise ValueError(f"the int4 panel layout needs out % {PANEL} == 0, in % {INT4_BLOCK} == 0 and a group_size "
                         f"that is a multiple of {INT4_BLOCK} dividing in; got out={n}, in={k}, "
                         f"group_size={group_size}")


def pack_int4_panels(u: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     group_size: int) -> Int4Panels:
    """Unsigned values ``u`` [out, in] (0..15), ``scales`` [out, in/group_size] (stored as float16) and zero
    points [out, in/group_size] (0..15; None: 8) -> :class:`Int4Panels`."""
    n, k = u.shape
    _check_int4_panels(n, k, group_size)
    g = k // group_size
    if tuple(scales.shape) != (n, g) or (zeros is not None and tuple(zeros.shape) != (n, g)):
        raise ValueError(f"int4 panels: scales/zeros must be [{n}, {g}], got {tuple(scales.shape)} / "
                         f"{None if zeros is None else tuple(zeros.shape)}")
    v = u.to(torch.int32) & 0xF
    # [n/16, 16 rows, k/8 blocks, 4 c, 2 e] -> [n/16, blocks, rows, e, c]; word (row, e) = sum_c v << 4c
    v = v.reshape(n // PANEL, PANEL, k // INT4_BLOCK, 4, 2).permute(0, 2, 1, 4, 3)
    words = (v << torch.tensor([0, 4, 8, 12], dtype=torch.int32)).sum(-1)        # [n/16, blocks, 16, 2]
    words = words.reshape(n // PANEL, k // INT4_BLOCK, 32)
    qweight = torch.stack([words & 0xFF, words >> 8], dim=-1).to(torch.uint8).reshape(n // PANEL, k // INT4_BLOCK, 64)

    def per_panel(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n // PANEL, PANEL, g).transpose(1, 2).contiguous()

    z = None if zeros is None else per_panel(zeros.to(torch.uint8))
    return Int4Panels(qweight.contiguous(), per_panel(scales.to(torch.float16)), z, group_size)


def unpack_int4_panels(panels: Int4Panels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_int4_panels`: (u uint8 [out, in], scales float16 [out, G], zeros uint8 [out, G])."""
    qw = panels.qweight
    npan, blocks, _ = qw.shape
    words = qw.reshape(npan, blocks, 32, 2).to(torch.int32)
    words = words[..., 0] | (words[..., 1] << 8)                                 # [n/16, blocks, 32]
    c = (words.unsqueeze(-1) >> torch.tensor([0, 4, 8, 12], dtype=torch.int32)) & 0xF   # [.., 32, 4]
    c = c.reshape(npan, blocks, PANEL, 2, 4).permute(0, 2, 1, 4, 3)              # [n/16, rows, blocks, c, e]
    u = c.reshape(npan * PANEL, blocks * INT4_BLOCK).to(torch.uint8)
    g = panels.scales.shape[1]

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(npan * PANEL, g)

    zeros = rows(panels.zeros) if panels.zeros is not None else torch.full((npan * PANEL, g), 8, dtype=torch.uint8)
    return u, rows(panels.scales), zeros


def quantize_int4_panels(w: torch.Tensor, group_size: int) -> Int4Panels:
    """kiln's symmetric group-wise int4 (:func:`quantize_int4`'s scheme: the element of largest magnitude maps to
    -8), with the scale rounded to float16 first and the values rounded against it, in the panel layout."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int4_panels expects a 2-D weight [out, in], got shape {tuple(w.shape)}")
    n, k = w.shape
    _check_int4_panels(n, k, group_size)
    wg = w.detach().float().reshape(n, k // group_size, group_size)
    idx = wg.abs().argmax(dim=2, keepdim=True)
    mx = torch.gather(wg, 2, idx).squeeze(2)
    s16 = torch.where(mx != 0, mx / -8.0, torch.ones_like(mx)).clamp(-65504.0, 65504.0).to(torch.float16)
    s16 = torch.where(s16 == 0, torch.ones_like(s16), s16)   # underflowed scales: the group is ~0 anyway
    q = torch.round(wg / s16.float()[..., None]).clamp_(-8, 7).to(torch.int32).reshape(n, k)
    return pack_int4_panels((q + 8).to(torch.uint8), s16, None, group_size)


def dequantize_int4_panels(panels: Int4Panels) -> torch.Tensor:
    """fp32 [out, in] weight of an :class:`Int4Panels`: (u - zero) * scale."""
    u, s, z = unpack_int4_panels(panels)
    n, k = u.shape
    g = s.shape[1]
    wg = u.float().reshape(n, g, k // g) - z.float()[..., None]
    return (wg * s.float()[..., None]).reshape(n, k)
