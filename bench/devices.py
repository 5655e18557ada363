"""Devices the capacity planner knows: memory, memory bandwidth, peak FLOP/s, interconnect.

Sources (vendor datasheets, dense figures, no sparsity):
  H100 SXM5 80GB — NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3, 3.35 TB/s, BF16/FP16 989.4 TFLOPS,
      FP32 67 TFLOPS, NVLink 900 GB/s.
  H200 SXM 141GB — NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e, 4.8 TB/s, BF16/FP16 989 TFLOPS,
      FP32 67 TFLOPS, NVLink 900 GB/s.
  A100 SXM4 80GB — NVIDIA A100 Tensor Core GPU datasheet: 80 GB HBM2e, 2,039 GB/s, BF16/FP16 312 TFLOPS,
      FP32 19.5 TFLOPS, NVLink 600 GB/s.
  L4 — NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s, BF16/FP16 121 TFLOPS (242 with
      sparsity), FP32 30.3 TFLOPS, PCIe Gen4 x16 64 GB/s.
  cpu:<GiB> — this project's 2-core AMD EPYC (Zen 3) VM, measured (../shared/notes/cpu-speed-facts.md):
      2-thread streaming read 19-20 GB/s, torch fp32 GEMM 85-97 GFLOP/s (no bf16 units: bf16 runs at the
      fp32 rate); memory is what the option says. Other CPUs: override with --bandwidth / --flops.
A datasheet's bandwidth and FLOP/s are peaks that kernels reach 60-90% of; ``kiln plan --calibration``
replaces both with what a ``kiln bench`` run of the engine measured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GB, GiB = 10**9, 2**30


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    bandwidth: float                 # bytes/s
    flops: dict[str, float]          # FLOP/s by compute dtype
    link_bandwidth: float | None     # bytes/s per device for tensor-parallel all-reduce
    source: str

    def flops_for(self, dtype: str) -> float:
        return self.flops.get(dtype) or self.flops["float32"]


_TABLE = {
    "h100-80gb": Device("h100-80gb", 80 * GB, 3.35e12, {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 67e12},
                        450e9, "NVIDIA H100 SXM5 datasheet"),
    "h200": Device("h200", 141 * GB, 4.8e12, {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
                   450e9, "NVIDIA H200 SXM datasheet"),
    "a100-80gb": Device("a100-80gb", 80 * GB, 2.039e12, {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
                        300e9, "NVIDIA A100 SXM4 80GB datasheet"),
    "l4": Device("l4", 24 * GB, 300e9, {"bfloat16": 121e12, "float16": 121e12, "float32": 30.3e12},
                 32e9, "NVIDIA L4 datasheet"),
}
CPU_BANDWIDTH = 20e9
CPU_FLOPS = 90e9
DEVICE_NAMES = (*_TABLE, "cpu:<GiB>")


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '24G' (GiB), '512MiB', or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"memory size {text!r}: use e.g. 80GiB, 80GB, 24G or a number of bytes")
    value, prefix, suffix = float(m.group(1)), m.group(2), m.group(3)
    power = " kmgt".index(prefix) if prefix else 0
    base = 1000 if suffix == "b" and prefix else 1024
    return int(value * base**power)


def get_device(name: str) -> Device:
    """A device of the table, or ``cpu:<size>`` (e.g. cpu:24, cpu:24GiB) with this project's measured CPU rates."""
    key = name.strip().lower()
    if key in _TABLE:
        return _TABLE[key]
    if key.startswith("cpu:"):
        size = key[4:]
        mem = parse_bytes(size if re.search(r"[a-z]", size) else size + "GiB")
        return Device(f"cpu:{size}", mem, CPU_BANDWIDTH, {"float32": CPU_FLOPS, "bfloat16": CPU_FLOPS}, None,
                      "the project's 2-core EPYC VM, measured (shared/notes/cpu-speed-facts.md)")
    raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICE_NAMES)} (or give --memory)")
