"""Pre-quantized int4 checkpoints (GPTQ, AWQ, compressed-tensors): their tensors -> kiln's int4 panels, without
re-quantizing.

A checkpoint whose config.json has a ``quantization_config`` with ``quant_method`` "gptq", "awq" or
"compressed-tensors" stores each
quantized linear as packed int32 tensors instead of ``<name>.weight``; every other tensor (embedding, norms,
usually the LM head) is a plain float one. What the formats store (both: 4-bit unsigned values ``q``, one fp16
scale ``s`` and one zero point ``z`` per group of ``group_size`` input features; ``w[n, k] = (q - z) * s``):

- GPTQ: ``qweight`` int32 [in/8, out], nibble j (bits 4j..4j+3) of row r = input 8r + j; ``qzeros`` int32
  [groups, out/8], nibble j of column c = output 8c + j; ``scales`` fp16 [groups, out]; ``g_idx`` int32 [in], the
  group of each input (act-order checkpoints, ``desc_act``, permute the inputs: kiln permutes x the same way
  and keeps the groups contiguous). ``checkpoint_format`` "gptq" (the default) stores ``z - 1``, "gptq_v2"
  stores ``z``. ``group_size`` -1 is one group per row.
- AWQ (``version`` "gemm"): ``qweight`` int32 [in, out/8] and ``qzeros`` int32 [groups, out/8], nibble j of
  column c = output 8c + AWQ_ORDER[j]; ``scales`` fp16 [groups, out]; no g_idx.
- compressed-tensors ``pack-quantized`` (llm-compressor's int4 format; 4-bit ``int`` weights, ``group`` or
  ``channel`` strategy): ``weight_packed`` int32 [out, in/8], nibble j of word c = input 8c + j, the signed value
  plus 8 (so ``q`` above); ``weight_scale`` [out, groups] in the model's float dtype (kiln keeps fp16 scales:
  fp32/bf16 ones are rounded to fp16); ``weight_zero_point`` (asymmetric only) int32 [out/8, groups] packed along
  the outputs, nibble j of row r = output 8r + j, plus 8 (a symmetric checkpoint's zero point is 8);
  ``weight_shape`` [out, in]; ``weight_g_idx`` as GPTQ's g_idx (activation order by group).

Each quantized linear becomes :class:`kiln.plugins.weight_format.Int4Panels` (the unsigned values, the fp16 scales
and the zero points as they are) plus, for act-order GPTQ, the input permutation; :func:`install` swaps the
module's ``nn.Linear`` for an :class:`Int4Linear` that calls ``kiln::weight_only_linear`` on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.contract import CheckpointError
from kiln.plugins import weight_format as fmt

__all__ = ["PREQUANT_SUFFIXES", "Prequantization", "read_quantization", "convert_linear", "Int4Linear", "install"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # AWQ's nibble j of a packed int32 holds output 8c + AWQ_ORDER[j]
PREQUANT_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx",
                     ".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx")
CT_METHOD = "compressed-tensors"
# the kiln tensors of one linear "<prefix>.weight": "<prefix>.int4_<part>"
PARTS = ("qweight", "scales", "zeros", "perm")


@dataclass(frozen=True)
class Prequantization:
    """What a checkpoint's ``quantization_config`` says about its quantized linears."""

    method: str          # "gptq" | "awq" | "compressed-tensors"
    group_size: int      # -1: one group per row (GPTQ)
    zero_plus_one: bool  # GPTQ v1 stores z - 1

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def group(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


def read_quantization(hf: dict, where: str) -> Prequantization | None:
    """The checkpoint's pre-quantization (None for a float checkpoint); a clear error for what kiln cannot read."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: quantization_config must be an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower()
    if method not in ("gptq", "awq", CT_METHOD):
        raise CheckpointError(f"{where}: quantization_config.quant_method {q.get('quant_method')!r} is not supported; "
                              "kiln reads GPTQ, AWQ and compressed-tensors int4 checkpoints (or build from the float "
                              "checkpoint with --quantization int4_weight_only)")
    if method == CT_METHOD:
        return _read_compressed_tensors(q, where)
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise CheckpointError(f"{where}: {method} with bits={bits} is not supported; kiln reads 4-bit checkpoints")
    gs = q.get("group_size", q.get("q_group_size", 128))
    if not isinstance(gs, int) or (gs != -1 and (gs <= 0 or gs % fmt.INT4_BLOCK)):
        raise CheckpointError(f"{where}: {method} group_size={gs!r} is not supported; kiln's int4 kernels take "
                              f"group sizes that are multiples of {fmt.INT4_BLOCK} (or -1)")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{where}: AWQ version {version!r} is not supported; kiln reads the 'gemm' packing")
        if q.get("zero_point", True) is not True:
            raise CheckpointError(f"{where}: AWQ with zero_point=false is not supported")
        return Prequantization("awq", gs, zero_plus_one=False)
    fmt_name = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt_name not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"{where}: GPTQ checkpoint_format {fmt_name!r} is not supported (gptq, gptq_v2)")
    return Prequantization("gptq", gs, zero_plus_one=fmt_name == "gptq")


def _read_compressed_tensors(q: dict, where: str) -> Prequantization:
    """compressed-tensors: every config group must be 4-bit int weights, weight-only, packed, one group size."""
    bad = f"{where}: compressed-tensors"
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{bad} quantization_config has no config_groups")
    sizes = set()
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise CheckpointError(f"{bad} config group {name!r} has no weights scheme")
        fmt_name = str(group.get("format") or q.get("format") or "").lower()
        if fmt_name != "pack-quantized":
            raise CheckpointError(f"{bad} format {fmt_name!r} (config group {name!r}) is not supported; kiln reads "
                                  "'pack-quantized' int4 weights")
        if group.get("input_activations") or group.get("output_activations"):
            raise CheckpointError(f"{bad} config group {name!r} quantizes activations; kiln reads weight-only "
                                  "checkpoints (W4A16)")
        w = group["weights"]
        if w.get("num_bits") != 4 or str(w.get("type", "int")).lower() != "int":
            raise CheckpointError(f"{bad} config group {name!r}: {w.get('type')} weights of {w.get('num_bits')} bits "
                                  "are not supported; kiln reads 4-bit int weights")
        strategy = str(w.get("strategy", "")).lower()
        if w.get("dynamic") or strategy not in ("group", "channel"):
            raise CheckpointError(f"{bad} config group {name!r}: strategy {w.get('strategy')!r}"
                                  f"{' (dynamic)' if w.get('dynamic') else ''} is not supported (group, channel)")
        gs = -1 if strategy == "channel" else w.get("group_size")
        if not isinstance(gs, int) or (gs != -1 and (gs <= 0 or gs % fmt.INT4_BLOCK)):
            raise CheckpointError(f"{bad} group_size={gs!r} is not supported; kiln's int4 kernels take group sizes "
                                  f"that are multiples of {fmt.INT4_BLOCK}")
        sizes.add(gs)
    if len(sizes) > 1:
        raise CheckpointError(f"{bad} config groups use different group sizes {sorted(sizes)}; kiln reads one")
    return Prequantization(CT_METHOD, sizes.pop(), zero_plus_one=False)


def _nibbles(t: torch.Tensor) -> torch.Tensor:
    """int32 [..., c] -> [..., c, 8] unsigned nibbles (nibble j = bits 4j..4j+3)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (t.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF


def _expect(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, where: str) -> torch.Tensor:
    if t is None:
        raise CheckpointError(f"{where}: missing tensor {name!r} (expected {list(shape)} {dtype})")
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{where}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} from "
                              "config.json and quantization_config")
    if t.dtype != dtype:
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {t.dtype}, expected {dtype}")
    return t


def convert_linear(pq: Prequantization, prefix: str, parts: dict[str, torch.Tensor], out_features: int,
                   in_features: int, where: str) -> dict[str, torch.Tensor]:
    """One quantized linear's checkpoint tensors (``parts``: suffix -> tensor) -> kiln's tensors named
    ``<prefix>.int4_qweight`` / ``int4_scales`` / ``int4_zeros`` (and ``int4_perm`` for act-order GPTQ)."""
    n, k = out_features, in_features
    gs, groups = pq.group(k), pq.groups(k)
    if k % gs or not fmt.can_pack_int4_panels(n, k, gs):
        raise CheckpointError(f"{where}: {prefix} [{n}, {k}] with group_size {gs}: kiln's int4 panels need out % 16 "
                              f"== 0, in % 8 == 0 and a group size dividing in")
    name = prefix + "."
    read = {CT_METHOD: _compressed_tensors_parts, "gptq": _gptq_parts, "awq": _awq_parts}[pq.method]
    u, z, scales, g_idx = read(pq, name, parts, n, k, groups, where)
    perm = None
    scale_name, g_idx_name = ("weight_scale", "weight_g_idx") if pq.method == CT_METHOD else ("scales", "g_idx")
    if g_idx is not None:
        g_idx = _expect(name + g_idx_name, g_idx, (k,), torch.int32, where).long()
        if not torch.equal(g_idx, torch.arange(k) // gs):   # act order: contiguous groups after a permutation
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], torch.arange(k) // gs):
                raise CheckpointError(f"{where}: {name}{g_idx_name} does not give every group {gs} inputs")
            u = u[:, perm]
    if not torch.isfinite(scales).all():
        raise CheckpointError(f"{where}: tensor {name}{scale_name} has NaN or infinite values; the checkpoint is "
                              "damaged")
    panels = fmt.pack_int4_panels(u.to(torch.uint8), scales, z.to(torch.uint8), gs)
    out = {name + "int4_qweight": panels.qweight, name + "int4_scales": panels.scales,
           name + "int4_zeros": panels.zeros}
    if perm is not None:
        out[name + "int4_perm"] = perm
    return out


# Each format's tensors of one linear -> (u [n, k], z [n, groups], fp16 scales [n, groups], g_idx or None).

def _gptq_parts(pq: Prequantization, name: str, parts: dict, n: int, k: int, groups: int, where: str):
    scales = _expect(name + "scales", parts.get(".scales"), (groups, n), torch.float16, where)
    qw = _expect(name + "qweight", parts.get(".qweight"), (k // 8, n), torch.int32, where)
    qz = _expect(name + "qzeros", parts.get(".qzeros"), (groups, n // 8), torch.int32, where)
    u = _nibbles(qw.t()).reshape(n, k)                       # [n, k/8, 8] -> input 8r + j
    z = _nibbles(qz).reshape(groups, n).t()                  # [groups, n/8, 8] -> output 8c + j
    return u, z + 1 if pq.zero_plus_one else z, scales.t(), parts.get(".g_idx")


def _awq_parts(pq: Prequantization, name: str, parts: dict, n: int, k: int, groups: int, where: str):
    scales = _expect(name + "scales", parts.get(".scales"), (groups, n), torch.float16, where)
    qw = _expect(name + "qweight", parts.get(".qweight"), (k, n // 8), torch.int32, where)
    qz = _expect(name + "qzeros", parts.get(".qzeros"), (groups, n // 8), torch.int32, where)
    order = torch.tensor(AWQ_ORDER)
    u = torch.empty(k, n // 8, 8, dtype=torch.int32)
    u[..., order] = _nibbles(qw)
    z = torch.empty(groups, n // 8, 8, dtype=torch.int32)
    z[..., order] = _nibbles(qz)
    return u.reshape(k, n).t(), z.reshape(groups, n).t(), scales.t(), None


def _compressed_tensors_parts(pq: Prequantization, name: str, parts: dict, n: int, k: int, groups: int, where: str):
    shape = parts.get(".weight_shape")
    if shape is not None and [int(v) for v in shape.reshape(-1).tolist()] != [n, k]:
        raise CheckpointError(f"{where}: tensor {name}weight_shape is {shape.tolist()}, expected {[n, k]} from "
                              "config.json")
    packed = _expect(name + "weight_packed", parts.get(".weight_packed"), (n, k // 8), torch.int32, where)
    u = _nibbles(packed).reshape(n, k)
    s = parts.get(".weight_scale")
    if s is None or tuple(s.shape) != (n, groups) or not s.is_floating_point():
        raise CheckpointError(f"{where}: tensor {name}weight_scale must be a float [{n}, {groups}] tensor, got "
                              f"{'none' if s is None else f'{s.dtype} {list(s.shape)}'}")
    s16 = s.to(torch.float16)
    if torch.isfinite(s).all() and not torch.isfinite(s16).all():
        raise CheckpointError(f"{where}: tensor {name}weight_scale has values beyond float16's range (largest "
                              f"{s.abs().max().item():.3g}); kiln's int4 panels keep fp16 scales")
    zp = parts.get(".weight_zero_point")
    if zp is None:
        z = torch.full((n, groups), 8, dtype=torch.int32)   # symmetric: the stored values are q + 8
    else:
        zp = _expect(name + "weight_zero_point", zp, ((n + 7) // 8, groups), torch.int32, where)
        z = _nibbles(zp.t()).reshape(groups, -1)[:, :n].t()   # nibble j of row r: output 8r + j (plus 8)
    g_idx = parts.get(".weight_g_idx")
    if g_idx is not None and not g_idx.is_floating_point():
        g_idx = g_idx.to(torch.int32)
    return u, z, s16, g_idx


class Int4Linear(nn.Module):
    """A linear on pre-quantized int4 panels: ``kiln::weight_only_linear(x[..., perm], ...)``."""

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool, act_order: bool):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        g = in_features // group_size
        self.register_buffer("int4_qweight", torch.empty(out_features // 16, in_features // 8, 64, dtype=torch.uint8))
        self.register_buffer("int4_scales", torch.empty(out_features // 16, g, 16, dtype=torch.float16))
        self.register_buffer("int4_zeros", torch.empty(out_features // 16, g, 16, dtype=torch.uint8))
        self.register_buffer("int4_perm", torch.empty(in_features, dtype=torch.long) if act_order else None)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4_perm is not None:
            x = x.index_select(-1, self.int4_perm)
        return torch.ops.kiln.weight_only_linear(x, self.int4_qweight, self.int4_scales, self.bias, 4,
                                                 self.group_size, self.int4_zeros)


def install(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Swap every ``nn.Linear`` of ``module`` whose ``<name>.int4_qweight`` is in ``state`` for an
    :class:`Int4Linear` of the same shape (before ``load_state_dict``)."""
    import kiln.plugins.linear  # noqa: F401  (registers kiln::weight_only_linear)

    for name, child in list(module.named_modules()):
        if not isinstance(child, nn.Linear) or f"{name}.int4_qweight" not in state:
            continue
        k = child.in_features
        gs = k // state[f"{name}.int4_scales"].shape[1]
        new = Int4Linear(k, child.out_features, gs, child.bias is not None, f"{name}.int4_perm" in state)
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, new)
