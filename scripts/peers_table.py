"""The side-by-side table of one run of ``../shared/peers/run_all_with_kiln.sh`` (kiln and its peers, same run).

    python scripts/peers_table.py $PEERS_DIR/results_small_<TAG>.jsonl [more runs ...]

Per class (fp32, bf16, int8): single-stream decode tok/s, batch 16 x (128 -> 64) tok/s and the single run's
peak RSS, kiln's engine next to the best peer of the class and their ratio; then whether kiln fp32's first
ids equal transformers fp32's. Ratios are only meaningful within one run (the machine's speed moves).
"""

from __future__ import annotations

import json
import sys

# class -> (kiln engines, peers of the class); labels as run_all_with_kiln.sh writes them
CLASSES = {
    "fp32": (["kiln-fp32-compiled"], ["ort-fp32", "llama-f32"]),
    "bf16": (["kiln-bf16-compiled", "kiln-bf16-cpu"], ["llama-bf16"]),
    "int8": (["kiln-int8-compiled"], ["llama-q8_0", "llama-q8_0-noextra"]),
}
MODES = {"single": "decode_tok_s", "batch": "batch_tok_s"}


def read(path: str) -> dict[str, dict]:
    rows = {}
    for line in open(path):
        row = json.loads(line)
        rows[row["label"]] = row["res"]
    return rows


def best(rows: dict[str, dict], names: list[str], mode: str) -> tuple[str, float] | None:
    """(label, tok/s) of the fastest of ``names`` in ``mode``; single also counts llama.cpp's high-level API
    cross-check (``single_hl``, the same engine driven through Llama.generate)."""
    labels = [f"{n}-{mode}" for n in names] + ([f"{n}-single_hl" for n in names] if mode == "single" else [])
    found = [(label, rows[label][MODES[mode]]) for label in labels if MODES[mode] in rows.get(label, {})]
    return max(found, key=lambda t: t[1]) if found else None


def table(rows: dict[str, dict]) -> list[str]:
    out = ["| class | mode | kiln (engine) | best peer | ratio |", "|---|---|---|---|---|"]
    for cls, (kiln, peers) in CLASSES.items():
        for mode in MODES:
            k, p = best(rows, kiln, mode), best(rows, peers, mode)
            if k is None or p is None:
                out.append(f"| {cls} | {mode} | {k} | {p} | - |")
                continue
            out.append(f"| {cls} | {mode} tok/s | {k[1]:.1f} ({k[0][5:].removesuffix('-' + mode)}) | {p[1]:.1f} "
                       f"({p[0]}) | {k[1] / p[1]:.2f}x |")
        k, p = (best(rows, kiln, "single"), best(rows, peers, "single"))
        if k and p:
            kr, pr = rows[k[0]]["peak_rss_mb"], rows[p[0]]["peak_rss_mb"]
            out.append(f"| {cls} | peak RSS MB (single) | {kr:.0f} | {pr:.0f} ({p[0]}) | {kr / pr:.2f}x |")
    hf = rows.get("hf-fp32-single", {}).get("first_ids")
    kf = rows.get("kiln-fp32-compiled-single", {}).get("first_ids")
    out.append(f"\nkiln fp32 first ids {'==' if hf == kf and hf else '!='} transformers fp32's ({kf} / {hf})")
    hs = {m: rows.get(f"hf-{d}-{m}", {}).get(MODES[m]) for d in ("fp32",) for m in MODES}
    out.append(f"transformers fp32: {hs['single']} tok/s single, {hs['batch']} batch; "
               f"load_s kiln fp32-compiled {rows.get('kiln-fp32-compiled-single', {}).get('load_s')}, "
               f"llama.cpp f32 {rows.get('llama-f32-single', {}).get('load_s')}")
    return out


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    for path in sys.argv[1:]:
        print(f"## {path}")
        print("\n".join(table(read(path))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
