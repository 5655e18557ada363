"""What the benchmark scripts share: timestamped progress lines and the ~300M Llama checkpoint."""

from __future__ import annotations

import fcntl
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "work" / "bench"
CKPT = BENCH / "llama-300m"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ensure_checkpoint() -> Path:
    """Create the random ~300M Llama once; a lock keeps two benchmarks from writing it together."""
    BENCH.mkdir(parents=True, exist_ok=True)
    with open(BENCH / ".llama-300m.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (CKPT / "config.json").exists():
            from kiln.model_defs.synthetic import make_checkpoint

            log(f"creating a random ~300M Llama checkpoint in {CKPT} (once) ...")
            make_checkpoint(CKPT, "llama", "300m")
    return CKPT
