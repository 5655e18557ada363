"""kiln's in-flight batching vs transformers static batches on one workload (not a test).

    .venv/bin/python scripts/bench_static_batching.py [--rate 1.0] [--requests 64] [--dtype float32]

A ~300M-parameter random Llama (``work/bench/llama-300m``, shared with the other benchmarks) is built into
an engine. ``kiln bench`` replays a Poisson workload (64 requests, prompts 32-512 tokens, outputs 16-256,
fixed by --seed) against it in-process. transformers serves the same requests (the same token ids: the
workload and prompts come from kiln.bench) in arrival order as static batches of 16 (``generate``,
left-padded; a batch starts when its 16th request has arrived and the previous batch is done, and all of
its requests end when its longest one does); its timeline is computed from the measured duration of each
batch, so no wall time is spent idling. Both results are kiln bench result files; the script ends with
``kiln bench compare`` of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_common import BENCH, CKPT, ensure_checkpoint, ensure_engine, log


def serving_engine(dtype: str, backend: str) -> Path:
    build = dict(dtype=dtype, max_batch_size=16, max_input_len=512, max_seq_len=768, max_num_tokens=256,
                 tokens_per_block=16, backend=backend)
    return ensure_engine(f"engine-serving-{dtype}-b16-t256{'' if backend == 'cpu' else '-' + backend}", build)


def run_transformers(engine_dir: Path, args, out_dir: Path) -> None:
    """The same requests through transformers static batches; written as a kiln bench result."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from kiln.bench import workload as wl
    from kiln.bench.cli import _vocab_and_specials, finish_result
    from kiln.bench.report import write_result
    from kiln.bench.runner import _rate_result
    from kiln.bench.stats import SLO
    from kiln.bench.targets import COMPLETED, RequestRecord

    base = wl.synthetic_workload(args.requests, rate=1.0, seed=args.seed,
                                 prompt_len=wl.LengthSpec.parse(args.prompt_len),
                                 output_len=wl.LengthSpec.parse(args.output_len))
    base.description.update(seed=args.seed, totals=base.totals())   # as kiln bench describes it
    work = base.at_rate(args.rate)
    vocab, specials, _ = _vocab_and_specials(engine_dir, None, None)
    synth = wl.PromptSynthesizer(vocab, args.seed, specials)
    model = AutoModelForCausalLM.from_pretrained(CKPT, dtype=getattr(torch, args.dtype)).eval()

    class FirstToken(LogitsProcessor):
        t: float | None = None

        def __call__(self, input_ids, scores):
            self.t = self.t or time.monotonic()
            return scores

    warm = torch.tensor([[5] * 16])
    with torch.no_grad():
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False, pad_token_id=0)
    records, clock = [], 0.0
    load = os.getloadavg()
    reqs = work.requests
    for b in range(0, len(reqs), args.batch):
        group = reqs[b:b + args.batch]
        prompts = [synth.prompt(r) for r in group]      # the ids kiln bench sent (run 0)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        new = max(r.output_len for r in group)
        first = FirstToken()
        t0 = time.monotonic()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0, logits_processor=LogitsProcessorList([first]))
        t1 = time.monotonic()
        start = max(clock, max(r.arrival for r in group))   # waits for its last request and the previous batch
        first_at, end = start + (first.t - t0), start + (t1 - t0)
        step = (t1 - first.t) / max(new - 1, 1)
        for r in group:
            rec = RequestRecord(r.index, r.arrival, r.prompt_len, r.output_len, sent=r.arrival, first_token=first_at,
                                last_token=first_at + (r.output_len - 1) * step, done=end, output_tokens=r.output_len,
                                outcome=COMPLETED, finish_reason="length")
            records.append(rec)
        clock = end
        log(f"  transformers batch {b // args.batch + 1}/{-(-len(reqs) // args.batch)}: {len(group)} x prompt<={width} "
            f"-> {new} tokens in {t1 - t0:.1f} s")
    run = _rate_result(work, records, [], {}, {}, SLO(), clock, load)
    config = {"command": "scripts/bench_static_batching.py", "workload": base.description, "slo": SLO().as_dict(),
              "rates": [args.rate], "target": {"kind": "transformers static batches", "batch": args.batch,
                                               "dtype": args.dtype, "timeline": "computed from measured batch times"}}
    write_result(finish_result(config, [run], SLO(), None, load[0], time.time()), out_dir / "result.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", default="32:512")
    ap.add_argument("--output-len", default="16:256")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cpu-compiled"])
    ap.add_argument("--batch", type=int, default=16, help="transformers static batch size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=BENCH / "static-batching")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ensure_checkpoint()
    engine = serving_engine(args.dtype, args.backend)
    kiln = str(Path(sys.executable).parent / "kiln")
    cmd = [kiln, "bench", "--engine", str(engine), "--rate", str(args.rate), "--num-requests", str(args.requests),
           "--prompt-len", args.prompt_len, "--output-len", args.output_len, "--seed", str(args.seed),
           "--capacity-policy", "max_utilization", "--threads", str(args.threads), "--no-progress",
           "--output", str(args.out / "kiln")]
    log("$ " + " ".join(cmd[1:]))
    subprocess.run(cmd, check=True)
    log("transformers: the same requests as static batches ...")
    run_transformers(engine, args, args.out / "transformers")
    subprocess.run([kiln, "bench", "compare", str(args.out / "transformers" / "result.json"),
                    str(args.out / "kiln" / "result.json")], check=True)
    print(json.dumps({"load_1m_end": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
