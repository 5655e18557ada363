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
"""

from __future__ import annotations

import torch

from kiln.plugins.native import ABI

__all__ = [
    "ROW_TILE", "K_STEP", "quantize_int8", "quantize_int4", "check_int4_group", "pack_int4", "unpack_int4",
    "can_pack_rows", "is_packed", "pack_rows", "unpack_rows", "weight_shape", "qweight_shape", "dequantize",
    "PANEL", "PAIR", "can_pack_panels", "is_panel", "pack_panels", "unpack_panels", "unpack",
]

ROW_TILE, K_STEP = ABI.row_tile, ABI.k_step  # packed weights: tiles of 8 rows, 16 input elements per step
PANEL, PAIR = ABI.panel, ABI.pair  # panels: 16 output rows; bf16/int8 interleave pairs of k


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
    """(out, in) of a quantised weight: int8 plain or packed, int4 [out, in//2]."""
    if bits == 8:
        return weight_shape(qweight)
    return qweight.shape[0], 2 * qweight.shape[1]


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """fp32 [out, in] weight that the quantised form stands for."""
    if bits == 8:
        q = unpack(qweight)
        return q.float() * scales.float()[:, None]
    if bits == 4:
        q = unpack_int4(qweight).float()
        n, k = q.shape
        check_int4_group(k, group_size)
        return (q.reshape(n, k // group_size, group_size) * scales.float()[..., None]).reshape(n, k)
    raise ValueError(f"bits must be 4 or 8, got {bits}")
