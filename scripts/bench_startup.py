"""Start-up time of a fresh process: ``import kiln.runtime``, the first ``LLM(engine)`` (which loads, or on a
cold machine compiles, the plugins' native kernels) and the first request.

    TORCH_EXTENSIONS_DIR=$(mktemp -d) python scripts/bench_startup.py work/demo-llama-corpus-engine

Run it with the python of the installation to measure (a source checkout's .venv, or a virtual
environment with the wheel installed); an empty TORCH_EXTENSIONS_DIR is a cold machine's cache.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    t0 = time.perf_counter()
    from kiln.plugins import native
    from kiln.runtime import LLM, SamplingParams

    t1 = time.perf_counter()
    llm = LLM(sys.argv[1], max_kv_cache_tokens=1024)
    t2 = time.perf_counter()
    out = llm.generate("The kiln fires the clay", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    t3 = time.perf_counter()
    llm.shutdown()
    lib = native.library()
    print(f"import {t1 - t0:.1f} s, LLM() {t2 - t1:.1f} s, first request {t3 - t2:.2f} s; "
          f"kernels: {lib._name if lib is not None else 'plain torch'}; output {out.text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
