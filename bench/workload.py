"""Workloads: request arrival times and lengths, from a trace file or synthesised, and their prompts.

A workload is a list of :class:`RequestSpec` (arrival offset in seconds, prompt and output length, an
optional shared prefix). Arrivals are kept in a *shape* that is rescaled to each rate of a sweep, so
every rate replays the same pattern (same lengths, same burstiness) only faster or slower.

Prompts are token ids drawn from the vocabulary by a generator seeded with (seed, request index), so a
request's prompt does not depend on the other requests and lengths are exact (no tokenizer round trip).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import numpy as np

ARRIVAL_COLUMNS = ("timestamp", "arrival_time", "arrival", "time")
PROMPT_COLUMNS = ("contexttokens", "prompt_len", "prompt_tokens", "input_len", "input_tokens")
OUTPUT_COLUMNS = ("generatedtokens", "output_len", "output_tokens", "max_tokens")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file, the line and the field."""


@dataclass(frozen=True)
class TraceRow:
    arrival: float        # seconds since the first request of the trace
    prompt_len: int
    output_len: int
    line: int             # line number in the file (1 = first line)


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival: float        # seconds after the start of the run
    prompt_len: int       # total prompt tokens (shared prefix included)
    output_len: int
    prefix_id: int | None = None
    prefix_len: int = 0


@dataclass
class Workload:
    """Requests plus a description of how they were made (printed and stored in the result)."""

    requests: list[RequestSpec]
    description: dict = field(default_factory=dict)

    @property
    def mean_rate(self) -> float:
        """Requests per second of the arrival pattern ((n - 1) / span; inf when all arrive at once)."""
        if len(self.requests) < 2:
            return math.inf
        span = self.requests[-1].arrival - self.requests[0].arrival
        return (len(self.requests) - 1) / span if span > 0 else math.inf

    def at_rate(self, rate: float) -> Workload:
        """The same requests with arrival times scaled so the mean rate is ``rate`` (inf: all at t=0)."""
        if rate <= 0:
            raise ValueError(f"a request rate must be > 0, got {rate}")
        t0 = self.requests[0].arrival if self.requests else 0.0
        natural = self.mean_rate
        if math.isinf(rate) or math.isinf(natural):
            reqs = [replace(r, arrival=0.0) for r in self.requests]
            factor = 0.0
        else:
            factor = natural / rate
            reqs = [replace(r, arrival=(r.arrival - t0) * factor) for r in self.requests]
        desc = dict(self.description, rate=rate if not math.isinf(rate) else "max",
                    time_scale=factor, pattern_rate=natural if not math.isinf(natural) else "all at once")
        return Workload(reqs, desc)

    def totals(self) -> dict:
        p = np.array([r.prompt_len for r in self.requests])
        o = np.array([r.output_len for r in self.requests])
        return {"requests": len(self.requests), "prompt_tokens": int(p.sum()), "output_tokens": int(o.sum()),
                "prompt_len": length_summary(p), "output_len": length_summary(o)}


def length_summary(x) -> dict:
    x = np.asarray(x, dtype=float)
    if x.size == 0:
        return {}
    return {"mean": float(x.mean()), "p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90)),
            "p95": float(np.percentile(x, 95)), "max": float(x.max())}


# ---- trace files --------------------------------------------------------------------------------------
def _pick(columns: list[str], names: tuple[str, ...], what: str, path: Path) -> str:
    low = {c.strip().lower(): c for c in columns}
    for n in names:
        if n in low:
            return low[n]
    raise TraceError(f"{path}: no {what} column; expected one of {list(names)} (case-insensitive), found {columns}")


def _parse_time(value: str) -> float:
    """Seconds: a number, or an ISO date-time (any number of fractional digits) as a POSIX timestamp."""
    try:
        return float(value)
    except ValueError:
        pass
    text = value.strip().replace("T", " ")
    frac = 0.0
    if "." in text:
        text, digits = text.split(".", 1)
        if not digits.isdigit():
            raise ValueError(value)
        frac = float("0." + digits)
    return datetime.fromisoformat(text).timestamp() + frac


def _int_field(value, column: str, where: str, minimum: int) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise TraceError(f"{where}: {column} {value!r} is not an integer") from None
    if n < minimum:
        raise TraceError(f"{where}: {column} {n} must be >= {minimum}")
    return n


def read_trace(path: str | Path) -> list[TraceRow]:
    """Rows of a CSV (header row) or JSON-lines trace, sorted by arrival, arrivals relative to the first.

    Columns (case-insensitive): arrival = timestamp | arrival_time | arrival | time (seconds or ISO
    date-time); prompt = ContextTokens | prompt_len | prompt_tokens | input_len | input_tokens;
    output = GeneratedTokens | output_len | output_tokens | max_tokens.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    records: list[tuple[int, dict]] = []
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        with open(path) as f:
            for i, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{path} line {i}: not valid JSON ({exc.msg})") from None
                if not isinstance(obj, dict):
                    raise TraceError(f"{path} line {i}: expected a JSON object, got {type(obj).__name__}")
                records.append((i, obj))
        columns = list(records[0][1]) if records else []
    else:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or [])
            for row in reader:
                if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
                    continue
                if None in row or any(v is None for v in row.values()):
                    raise TraceError(f"{path} line {reader.line_num}: expected {len(columns)} fields "
                                     f"({', '.join(columns)})")
                records.append((reader.line_num, row))
    if not records:
        raise TraceError(f"{path}: the trace has no requests")
    a_col = _pick(columns, ARRIVAL_COLUMNS, "arrival-time", path)
    p_col = _pick(columns, PROMPT_COLUMNS, "prompt-length", path)
    o_col = _pick(columns, OUTPUT_COLUMNS, "output-length", path)
    parsed = []
    for line, rec in records:
        where = f"{path} line {line}"
        for col in (a_col, p_col, o_col):
            if col not in rec or rec[col] in (None, ""):
                raise TraceError(f"{where}: field {col} is missing")
        try:
            t = _parse_time(str(rec[a_col]))
        except ValueError:
            raise TraceError(f"{where}: {a_col} {rec[a_col]!r} is neither seconds nor an ISO date-time") from None
        if not math.isfinite(t):
            raise TraceError(f"{where}: {a_col} {rec[a_col]!r} is not finite")
        parsed.append((t, _int_field(rec[p_col], p_col, where, 1), _int_field(rec[o_col], o_col, where, 1), line))
    parsed.sort(key=lambda r: r[0])  # stable: equal arrivals keep file order
    t0 = parsed[0][0]
    return [TraceRow(t - t0, p, o, line) for t, p, o, line in parsed]


def trace_workload(rows: list[TraceRow], *, window: tuple[float, float] | None = None, max_requests: int | None = None,
                   prompt_scale: float = 1.0, output_scale: float = 1.0, source: str = "") -> Workload:
    """A workload from trace rows: a time window [start, end) of the trace (seconds from its start), the
    first ``max_requests`` of it, lengths multiplied by the scales (rounded, at least 1 token).
    ``clip_to_bounds`` then fits them to an engine."""
    if prompt_scale <= 0 or output_scale <= 0:
        raise ValueError("length scales must be > 0")
    sel = rows
    if window is not None:
        lo, hi = window
        sel = [r for r in sel if lo <= r.arrival < hi]
    if max_requests is not None:
        sel = sel[:max_requests]
    if not sel:
        raise TraceError(f"{source or 'trace'}: no request in window {window}")
    t0 = sel[0].arrival
    reqs = [RequestSpec(i, r.arrival - t0, max(1, round(r.prompt_len * prompt_scale)),
                        max(1, round(r.output_len * output_scale))) for i, r in enumerate(sel)]
    desc = {"kind": "trace", "source": source, "trace_requests": len(rows),
            "window_s": list(window) if window else None,
            "max_requests": max_requests, "prompt_scale": prompt_scale, "output_scale": output_scale}
    return Workload(reqs, desc)


# ---- synthetic workloads ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LengthSpec:
    """'128' (fixed), '64:256' (uniform, inclusive) or 'trace' (the trace's empirical distribution)."""

    kind: str
    low: int = 0
    high: int = 0

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        text = str(text).strip()
        if text == "trace":
            return cls("trace")
        try:
            if ":" in text:
                lo, hi = (int(x) for x in text.split(":", 1))
            else:
                lo = hi = int(text)
        except ValueError:
            raise ValueError(f"length {text!r}: use N, LOW:HIGH or 'trace'") from None
        if not 1 <= lo <= hi:
            raise ValueError(f"length {text!r}: need 1 <= LOW <= HIGH")
        return cls("fixed" if lo == hi else "uniform", lo, hi)

    def sample(self, rng: np.random.Generator, n: int, empirical: list[int] | None) -> np.ndarray:
        if self.kind == "trace":
            if not empirical:
                raise ValueError("length 'trace' needs --trace FILE for the empirical distribution")
            return rng.choice(np.asarray(empirical), size=n, replace=True)
        return rng.integers(self.low, self.high + 1, size=n)

    def __str__(self) -> str:
        if self.kind == "trace":
            return "trace"
        return str(self.low) if self.kind == "fixed" else f"{self.low}:{self.high}"


def arrival_offsets(n: int, rate: float, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """n arrival times (first at 0) of a gamma renewal process at ``rate`` req/s; burstiness 1 = Poisson,
    < 1 burstier, > 1 more regular (shape = burstiness, mean gap = 1 / rate)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    rng = np.random.default_rng([seed, 0xA11])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


def synthetic_workload(n: int, *, rate: float = 1.0, seed: int = 0, burstiness: float = 1.0,
                       prompt_len: LengthSpec = LengthSpec("fixed", 128, 128),
                       output_len: LengthSpec = LengthSpec("fixed", 128, 128),
                       trace_rows: list[TraceRow] | None = None) -> Workload:
    if n < 1:
        raise ValueError(f"the workload needs at least 1 request, got {n}")
    rng = np.random.default_rng([seed, 0x1E9])
    t = arrival_offsets(n, rate, seed, burstiness)
    p = prompt_len.sample(rng, n, [r.prompt_len for r in trace_rows] if trace_rows else None)
    o = output_len.sample(rng, n, [r.output_len for r in trace_rows] if trace_rows else None)
    reqs = [RequestSpec(i, float(t[i]), int(p[i]), int(o[i])) for i in range(n)]
    arrivals = "poisson" if burstiness == 1 else f"gamma (shape {burstiness})"
    return Workload(reqs, {"kind": "synthetic", "arrivals": arrivals,
                           "pattern_rate_requested": rate, "prompt_len": str(prompt_len), "output_len": str(output_len),
                           "seed": seed})


def with_shared_prefix(workload: Workload, num_prefixes: int, prefix_len: int, seed: int) -> Workload:
    """Each request's prompt starts with one of ``num_prefixes`` system prompts of ``prefix_len`` tokens
    (picked by seed); the request's own tokens follow, so its prompt grows by ``prefix_len``."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError("shared prefix needs N >= 1 prompts of L >= 1 tokens")
    rng = np.random.default_rng([seed, 0x9F1])
    pick = rng.integers(0, num_prefixes, size=len(workload.requests))
    reqs = [replace(r, prompt_len=r.prompt_len + prefix_len, prefix_id=int(k), prefix_len=prefix_len)
            for r, k in zip(workload.requests, pick)]
    return Workload(reqs, dict(workload.description, shared_prefix={"prompts": num_prefixes, "tokens": prefix_len}))


def clip_to_bounds(workload: Workload, max_input_len: int, max_seq_len: int) -> Workload:
    """Fit every request to an engine's bounds, so that none is refused for its lengths: the prompt to
    ``min(max_input_len, max_seq_len - 1)`` (room for at least one generated token), the output to
    ``max_seq_len - prompt``. The description's ``clip`` counts the clipped prompts, outputs and requests."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len={max_seq_len}: an engine must hold a prompt token and a generated one")
    prompt_cap = min(max_input_len, max_seq_len - 1)
    reqs, cp, co, cr = [], 0, 0, 0
    for r in workload.requests:
        p = min(r.prompt_len, prompt_cap)
        o = min(r.output_len, max_seq_len - p)
        cp, co, cr = cp + (p < r.prompt_len), co + (o < r.output_len), cr + (p < r.prompt_len or o < r.output_len)
        reqs.append(replace(r, prompt_len=p, output_len=o, prefix_len=min(r.prefix_len, p)))
    clip = {"max_input_len": max_input_len, "max_seq_len": max_seq_len, "max_prompt_len": prompt_cap,
            "prompts_clipped": cp, "outputs_clipped": co, "requests_clipped": cr, "requests": len(reqs)}
    return Workload(reqs, dict(workload.description, clip=clip))


def clip_summary(clip: dict) -> str:
    """One line for the user: how many requests ``clip_to_bounds`` changed, and how."""
    return (f"--clip-to-engine: {clip['requests_clipped']} of {clip['requests']} requests clipped "
            f"({clip['prompts_clipped']} prompts to <= {clip['max_prompt_len']} tokens, {clip['outputs_clipped']} "
            f"outputs to fit max_seq_len {clip['max_seq_len']})")


# ---- prompts ----------------------------------------------------------------------------------------------
class PromptSynthesizer:
    """Token-id prompts of exact lengths, drawn from the vocabulary minus special tokens, seeded per request."""

    def __init__(self, vocab_size: int, seed: int = 0, exclude: set[int] | frozenset[int] = frozenset()):
        allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(exclude, dtype=np.int64, count=len(exclude)))
        if allowed.size == 0:
            raise ValueError("no token id left to build prompts from")
        self.allowed = allowed
        self.seed = seed

    def _draw(self, key: list[int], n: int) -> list[int]:
        rng = np.random.default_rng([self.seed, *key])
        return self.allowed[rng.integers(0, self.allowed.size, size=n)].tolist()

    def warmup_prompt(self, i: int, n: int) -> list[int]:
        return self._draw([0x3A, i], n)

    def prompt(self, spec: RequestSpec, run: int = 0) -> list[int]:
        """The prompt of ``spec`` in run ``run`` of a sweep: each run gets fresh tokens (an earlier rate's
        requests must not be prefix-cache hits for a later one); shared prefixes are the same in every run."""
        own = spec.prompt_len - spec.prefix_len
        prefix = self._draw([0x9F1, spec.prefix_id], spec.prefix_len) if spec.prefix_id is not None else []
        return prefix + self._draw([run, spec.index], own)
