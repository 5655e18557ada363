"""The panel kernels' tunables: chosen per machine once, at the native library's first load, and cached.

The kernels pick their instruction set from CPUID (AVX-512 with VNNI where present, else AVX2 + FMA); what depends
on the microarchitecture's caches and memory system beyond that are the software prefetch distances (bytes ahead in
a weight stream): ``row_prefetch`` (one-row decode, int8/int4), ``small_prefetch`` (batched decode, M <= 32: the
first pass over each tile), ``onepass_prefetch`` (AVX-512 one-pass 13..16 rows), ``bf16_row_prefetch`` (bf16-panel
decode, M < 4) and ``int8_row_prefetch`` (int8 one-row decode over several streams); ``onepass_split``: whether an
AVX-512 batched decode of 13..16 rows (fp32 x) runs rows 0..11 then 12..15 over pairs of panels (1) or all 16 rows
over one panel (0); how many panels a decode thread reads at once (``row_panels`` / ``int8_row_panels``, int4 / int8
one row: 1 = one sequential stream; where the hardware prefetcher follows one stream per page, several interleaved
ones keep more lines in flight: 2, 4 or 8 where they divide the panels, else 4, else 1;
``bf16_row_panels``: the panels of a bf16 decode tile with bf16 x, 2 to 16); and ``row_nta``: whether the int8/int4
one-row streams prefetch non-temporally (1, the default off Intel: a decode step reads each weight once, and ~100 MB
of them passing through L2/L3 push out what the step reuses, the KV context and the step loop's own objects);
``row_burst``: how many bytes each thread of an int8/int4 one-row decode asks for at once at the start of its run
(0: none); ``attn_span_context``: decode attention reads every KV head of a position at once, in position order (one
work item per row when there are as many rows as threads), and with fewer rows than threads splits a row of at least
this many positions across them; shorter ones run one KV head per work item (0: always).

The library starts with per-microarchitecture defaults (``default_tuning`` in ``csrc/linear_kernels.cpp``); then
:func:`apply` loads this machine's measured choice from the cache, or measures it (:func:`autotune`, ~1-3 s: the
int4 and int8 decode kernels and a 16-row fp32 GEMM streaming weights from memory at each candidate) and caches
it, a JSON file named by the library's build key and the CPU (:func:`cache_path`, beside the kernel cache in
TORCH_EXTENSIONS_DIR). ``KILN_AUTOTUNE=0`` keeps the defaults; ``KILN_TUNING=name=value,...`` sets values.
The measurement is a guard (:func:`choose`): a default stands unless the kernel alone runs clearly slower with it. Not
measured here, because a kernel timed alone does not show them: ``row_burst``, ``bf16_row_panels`` and
``bf16_row_prefetch`` (on Zen 4 alike alone, 3-9% apart in whole decodes): their defaults come from whole
single-stream decodes (``scripts/bench_tunables.py``); nor ``attn_span_context`` (attention's, not a linear
kernel's: ``scripts/bench_decode_attention.py --spans``). With ``row_nta`` on, the one-row prefetch distances are
chosen among non-zero candidates (no prefetch would leave the stream to the hardware prefetcher, which fills every
level).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("kiln.plugins")

__all__ = ["TUNABLES", "get", "set_value", "current", "cpu_signature", "cache_path", "choose", "autotune", "apply",
           "describe_kernel"]

TUNABLES = ("row_prefetch", "small_prefetch", "onepass_prefetch", "row_panels", "int8_row_panels", "bf16_row_prefetch",
            "int8_row_prefetch", "row_nta", "bf16_row_panels", "row_burst", "attn_span_context", "onepass_split")
CANDIDATES = (0, 512, 1024, 2048, 4096, 8192)
NTA_CANDIDATES = (256, 512, 1024, 2048, 4096, 8192)
# Within this factor of the fastest a default stands (else the shortest distance within it wins): on a shared 2-core
# VM the best of 5 interleaved rounds still moves by 5-10% between loads, and with a 3% margin the same Zen 4 machine
# cached every row_prefetch candidate from 0 to 8192 across builds of the library.
TIE = 1.08
# The version of choose()'s rule, in the cache's file name: a machine measured under an older rule measures again.
CHOICE_RULE = 2
ROUNDS = 5
# The tunables that are not distances: where one's default is clearly slower alone, the fastest candidate replaces it.
# Their per-CPU defaults come from whole decodes, where they differ more than alone. row_nta: its gain is what the
# stream does not evict (Zen 4: x1.06-1.24 whole, the kernel alone alike); on Sapphire Rapids a non-temporal stream is
# not followed by the L2 streamer and reads at about half the rate even alone. The panel counts: on Sapphire Rapids 8
# int4 panels a thread (AVX-512) run faster than 4 both alone and in whole decodes (docs/benchmarks.md).
# onepass_split (two kernels for the same rows; 1 everywhere): measured in case a CPU runs the 16-row kernel clearly
# faster.
SWITCHES = ("row_nta", "row_panels", "int8_row_panels", "onepass_split")


def get(lib, name: str) -> int:
    value = ctypes.c_int64()
    if lib.kiln_get_tuning(name.encode(), ctypes.byref(value)) != 0:
        raise ValueError(f"unknown kernel tunable {name!r}; the tunables are {list(TUNABLES)}")
    return value.value


def set_value(lib, name: str, value: int) -> None:
    rc = lib.kiln_set_tuning(name.encode(), int(value))
    if rc == 1:
        raise ValueError(f"unknown kernel tunable {name!r}; the tunables are {list(TUNABLES)}")
    if rc == 2:
        raise ValueError(f"kernel tunable {name}={value} is out of range (prefetch distances 0..65536 bytes, "
                         "row_panels 1, 2, 4 or 8, int8_row_panels the same, bf16_row_panels 2, 4, 8 or 16, "
                         "row_nta 0 or 1)")


def current(lib) -> dict[str, int]:
    return {name: get(lib, name) for name in TUNABLES}


def cpu_signature() -> str:
    """vendor-family-model plus the vector extensions the kernels care about, e.g. ``AuthenticAMD-25-1-avx2``."""
    from kiln.plugins.native import cpu_info

    info = cpu_info()
    flags = set(info.get("flags", "").split())
    isa = "avx512vnni" if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags else "avx2"
    return "-".join([info.get("vendor_id", "cpu"), info.get("cpu family", "0"), info.get("model", "0"), isa])


def cache_path(build_key: str) -> Path:
    root = os.environ.get("KILN_TUNING_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR") or \
        str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / "kiln_tuning" / f"{build_key}-{cpu_signature()}-rule{CHOICE_RULE}.json"


def _time_calls(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


class TuningAborted(RuntimeError):
    """The measurement ran past its time budget (a machine busy with other work): nothing worth caching."""


def choose(name: str, times: dict[int, float], default: int) -> int:
    """The candidate to keep (``times``: seconds per candidate): ``default`` (the per-CPU one) unless it is slower than
    TIE x the fastest; then, for a distance, the smallest within TIE of the fastest, and for the tunables of
    :data:`SWITCHES` the fastest. The defaults come from whole decodes, where a weight's stream starts after the
    step's other work; back to back, alone, the hardware prefetcher is already running and a software distance shows
    less (Sapphire Rapids, int4: ``row_prefetch`` 0 ran within TIE of 2048 alone and x0.91 in whole decodes)."""
    fastest = min(times.values())
    if default in times and times[default] <= TIE * fastest:
        return default
    if name in SWITCHES:
        return min(times, key=times.__getitem__)
    return min(times, key=lambda c: (times[c] > TIE * fastest, c))


def _cpu_ticks() -> tuple[int, int] | None:
    """(ticks the machine's CPUs were busy or stolen by the hypervisor, ticks this process ran), from /proc; None
    where /proc cannot tell."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return user + nice + system + irq + softirq + steal, int(fields[11]) + int(fields[12])   # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def other_load(since: tuple[int, int] | None, wall_s: float) -> float:
    """Cores' worth of CPU time that other processes (and the hypervisor's steal) took since ``since``
    (:func:`_cpu_ticks`) over ``wall_s`` seconds; 0.0 where /proc cannot tell."""
    now = _cpu_ticks()
    if since is None or now is None:
        return 0.0
    return max(0, (now[0] - since[0]) - (now[1] - since[1])) / (os.sysconf("SC_CLK_TCK") * max(wall_s, 1e-3))


def autotune(lib, nthreads: int, budget_s: float = 6.0, max_other_load: float = 0.25) -> dict[str, int]:
    """Measure the prefetch distances on this machine: int4 panel GEMVs (4096 x 1024, 2 MiB each) rotated over
    96 MiB, so that every call streams its weight from memory as a decode step does; :func:`choose` keeps a
    candidate. Raises :class:`TuningAborted` (the tunables back as they were) past ``budget_s`` seconds, or when
    other processes kept busy more than ``max_other_load`` cores beyond those the measurement leaves free
    (:func:`other_load`; a compiler still running from an engine build): on a machine that busy the timings would be
    noise (on Sapphire Rapids a tuning measured beside a compile ran whole int4 decodes at 0.84x the defaults)."""
    import torch

    start = time.perf_counter()
    ticks = _cpu_ticks()
    before = current(lib)
    n, k, gs = 4096, 1024, 128
    copies = 48
    g = torch.Generator().manual_seed(0)
    # One 96 MiB buffer of random bytes serves both formats in turn (two of their own would add 192 MiB to the
    # peak RSS of the process that loads the library first).
    raw = torch.randint(0, 256, (copies * (n // 16) * (k // 8) * 64,), dtype=torch.uint8, generator=g)
    weights = list(raw.view(copies, n // 16, k // 8, 64))   # int4 panels, 2 MiB each
    scales = torch.full((n // 16, k // gs, 16), 0.01, dtype=torch.float16)
    # int8 panels of the same shape (4 MiB each), half as many copies
    int8_weights = list(raw.view(torch.int8).view(copies // 2, n // 16, k // 2, 16, 2))
    int8_scales = torch.full((n,), 0.01)
    int8_panel = _panel_type("int8_panel")
    chosen = current(lib)
    wide = lib.kiln_panel_isa() == 512
    # 8 panels a decode thread only where 32 vector registers hold their sums (AVX2's 16 would spill them)
    streams = (1, 2, 4, 8) if wide else (1, 2, 4)
    plan = [("row_nta", 1, (0, 1)), ("row_panels", 1, streams), ("row_prefetch", 1, None),
            ("small_prefetch", 8, CANDIDATES), ("int8_row_panels", 1, streams), ("int8_row_prefetch", 1, None)]
    fp32_weights: list[torch.Tensor] = []
    fp32_panel = _panel_type("fp32_panel")
    if wide:   # the 13..16-row kernels exist only on AVX-512
        plan += [("onepass_split", 16, (0, 1)), ("onepass_prefetch", 16, CANDIDATES)]
        # fp32 panels of the same buffer, 16 MiB each, every exponent set to 2^-1 (random bytes hold NaNs and
        # denormals); the int4 and int8 kernels take as long on these bytes as on any
        sign_and_mantissa = 0x807FFFFF - (1 << 32)   # as an int32
        fp32_weights = list(raw.view(torch.int32).bitwise_and_(sign_and_mantissa).bitwise_or_(0x3F000000)
                            .view(torch.float32).view(-1, n * k))
    for name, rows, candidates in plan:
        # a non-temporal one-row stream needs its software prefetch (row_nta): no zero distance for it, and shorter
        # ones (in whole decodes on Zen 4, 256-512 B beat 1-8 KiB)
        candidates = candidates or (NTA_CANDIDATES if chosen["row_nta"] else CANDIDATES)
        # the default is measured too (it stands unless clearly slower); a zero default only where zero is already
        # a candidate (a non-temporal stream's distances exclude it)
        if chosen[name]:
            candidates = tuple(sorted({*candidates, chosen[name]}))
        x = torch.randn(rows, k)
        y = torch.empty(rows, n)
        idx = [0]

        def call():
            i = idx[0]
            idx[0] += 1
            if name in ("onepass_split", "onepass_prefetch"):
                w = fp32_weights[i % len(fp32_weights)]
                lib.kiln_linear(fp32_panel, w.data_ptr(), None, 0, x.data_ptr(), rows, n, k, None, y.data_ptr(),
                                nthreads, 0)
                return
            if name in ("int8_row_panels", "int8_row_prefetch"):
                w = int8_weights[i % len(int8_weights)]
                lib.kiln_linear(int8_panel, w.data_ptr(), int8_scales.data_ptr(), 0, x.data_ptr(), rows, n, k, None,
                                y.data_ptr(), nthreads, 0)
                return
            w = weights[i % copies]
            lib.kiln_linear_int4_panel(w.data_ptr(), scales.data_ptr(), None, gs, x.data_ptr(), rows, n, k, None,
                                       y.data_ptr(), nthreads, 0)

        times = dict.fromkeys(candidates, float("inf"))
        call()
        for _ in range(ROUNDS):   # candidates interleaved round by round: a slow minute slows all of them
            for cand in candidates:
                set_value(lib, name, cand)
                times[cand] = min(times[cand], _time_calls(call, copies // 2))
            # checked every round, so that a busy machine gives up after a fraction of a second, not the whole run
            why = None
            if time.perf_counter() - start > budget_s:
                why = f"kernel autotuning took over {budget_s:.0f} s"
            others = other_load(ticks, time.perf_counter() - start)
            if others > max(0, (os.cpu_count() or 1) - nthreads) + max_other_load:
                why = f"other processes kept {others:.2f} cores busy during the kernel autotuning"
            if why:
                for key, value in before.items():
                    set_value(lib, key, value)
                raise TuningAborted(f"{why} (a busy machine); kept the per-CPU defaults")
        best = choose(name, times, chosen[name])
        chosen[name] = best
        set_value(lib, name, best)
        logger.info("kiln autotune %s: %s -> %d", name, {c: round(t * 1e3, 2) for c, t in times.items()}, best)
    return chosen


def _panel_type(name: str) -> int:
    from kiln.plugins.native import ABI

    return ABI.weight_types[name]


def _cached(path: Path) -> dict[str, int] | None:
    try:
        values = json.loads(path.read_text())["tuning"]
        return {name: int(values[name]) for name in values if name in TUNABLES}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _measure_and_cache(lib, path: Path) -> None:
    import torch

    from kiln.plugins.openmp_teams import on_own_thread

    try:   # the measuring thread's OpenMP team ends with it (kiln.plugins.openmp_teams)
        values = on_own_thread(autotune, lib, torch.get_num_threads(), name="kiln-autotune")
    except TuningAborted as exc:   # nothing cached: measured again at the next load
        logger.info("kiln: %s", exc)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"cpu": cpu_signature(), "tuning": values}, indent=1) + "\n")
        tmp.replace(path)
    except OSError as exc:   # a read-only cache directory: measured again next time
        logger.info("kiln: cannot cache the kernel tuning at %s (%s)", path, exc)


def apply(lib, build_key: str) -> dict[str, int]:
    """Set this machine's tunables (cache, else measured and cached, else the defaults; then KILN_TUNING);
    returns them."""
    if os.environ.get("KILN_AUTOTUNE", "1") not in ("0", "false", "False"):
        path = cache_path(build_key)
        values = _cached(path)
        if values is None:
            _measure_and_cache(lib, path)
        else:
            for name, value in values.items():
                set_value(lib, name, value)
    override = os.environ.get("KILN_TUNING", "")
    for item in filter(None, (s.strip() for s in override.split(","))):
        name, _, value = item.partition("=")
        try:
            set_value(lib, name.strip(), int(value))
        except ValueError as exc:
            raise ValueError(f"KILN_TUNING={override!r}: {exc}") from None
    return current(lib)


def describe_kernel(lib, wtype: int, m: int, n: int) -> str:
    """The kernel (ISA, blocking, prefetch) a panel-layout weight of type id ``wtype`` runs at ``m`` rows."""
    buf = ctypes.create_string_buffer(256)
    if lib.kiln_describe_kernel(int(wtype), int(m), int(n), buf, len(buf)) != 0:
        return "not a panel layout: the GEMV kernels of csrc/linear_kernels.cpp"
    return buf.value.decode()
