"""Tensor-parallel benchmark (not a test): TP=1 vs TP=2 decode step time on this machine, and what a TP=2 step
spends in its collectives and in the broadcast of its inputs.

    .venv/bin/python scripts/bench_tp.py [--size 246m] [--batches 1,8] [--steps 30] [--rounds 3]

A random Llama (a synthetic_checkpoints preset, created once under work/bench) is built as a TP=1 and a TP=2
engine (fp32, ``cpu`` backend). TP=1 runs with one torch thread per core; TP=2 with cores / 2 threads per
rank (the runtime's default: the two ranks share the machine). Each round runs, for each batch size and
each engine in turn, ``--steps`` decode steps of ``batch`` sequences holding 128 tokens of context
(``engine.run`` on a paged batch: no scheduler or sampler), so both engines see the same machine within a
round; medians are over every step of every round. For TP=2 the leader's time per step inside
``kiln::all_reduce`` / ``kiln::all_gather`` (the transfer plus the wait for the other rank to arrive) and in
the step broadcast is printed, with the bytes each step all-reduces; last, a gloo all-reduce of one step's
``[batch, hidden]`` fp32 between two otherwise idle processes (the transport alone, without the waiting).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist

from bench_common import decode_step_times, ensure_checkpoint, ensure_engine, log

CONTEXT = 128


def run_steps(engine, batch: int, steps: int, threads: int) -> tuple[list[float], dict]:
    """Step times of ``steps`` decode steps of ``batch`` sequences after a prefill of CONTEXT tokens each, and
    the communication counters' change over them (empty for one rank)."""
    torch.set_num_threads(threads)
    stats = getattr(engine, "comm_stats", dict)
    before = stats()
    times = decode_step_times(engine, batch, steps, CONTEXT)
    after = stats()
    return times, {k: after[k] - before.get(k, 0) for k in after}


def _peer(port: int, calls: int, numel: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    group = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), 1, 2, datetime.timedelta(seconds=60))
    x = torch.ones(numel)
    for _ in range(calls):
        group.allreduce([x]).wait()


def gloo_allreduce_seconds(numel: int, calls: int = 300, warmup: int = 30) -> float:
    """Mean seconds of one gloo all-reduce of ``numel`` fp32 between this process and a fresh one,
    both doing nothing else (the two enter each call together: no waiting)."""
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    peer = mp.get_context("spawn").Process(target=_peer, args=(store.port, calls + warmup, numel))
    peer.start()
    group = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), 0, 2, datetime.timedelta(seconds=60))
    x = torch.ones(numel)
    for _ in range(warmup):
        group.allreduce([x]).wait()
    t0 = time.perf_counter()
    for _ in range(calls):
        group.allreduce([x]).wait()
    took = (time.perf_counter() - t0) / calls
    peer.join()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="246m", help="synthetic_checkpoints preset of the Llama (default 246m)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from kiln.runtime import Engine
    from kiln.runtime.tensor_parallel import usable_cores

    cores = usable_cores()
    ckpt = ensure_checkpoint(args.size)
    build = dict(dtype="float32", max_batch_size=16, max_input_len=512, max_seq_len=1024, max_num_tokens=2048)
    engines = {tp: Engine.from_dir(ensure_engine(f"llama-{args.size}-tp{tp}", {**build, "tp_size": tp}, ckpt))
               for tp in (1, 2)}
    threads = {1: cores, 2: max(1, cores // 2)}
    model = engines[1].config.model
    batches = [int(b) for b in args.batches.split(",")]
    times: dict[tuple[int, int], list[float]] = {(tp, b): [] for tp in engines for b in batches}
    comm: dict[int, list[dict]] = {b: [] for b in batches}
    try:
        for r in range(args.rounds):
            for b in batches:
                for tp, engine in engines.items():
                    t, c = run_steps(engine, b, args.steps, threads[tp])
                    times[(tp, b)] += t
                    if tp == 2:
                        comm[b].append(c)
            log(f"round {r + 1}/{args.rounds} done")
    finally:
        engines[2].close()
    print(f"\n{model.architecture} {args.size}: {model.num_layers} layers, hidden {model.hidden_size}, vocab "
          f"{model.vocab_size}, fp32, cpu backend; {cores} cores: TP=1 {threads[1]} threads, TP=2 {threads[2]} per "
          f"rank; decode, {CONTEXT} tokens of context; median of {args.rounds} x {args.steps} steps")
    print(f"{'batch':>5} {'TP=1 ms':>9} {'TP=2 ms':>9} {'TP2/TP1':>8} {'all-reduce ms':>14} {'calls':>6} "
          f"{'all-gather ms':>14} {'broadcast ms':>13} {'all-reduced KiB':>16}")
    for b in batches:
        t1, t2 = statistics.median(times[(1, b)]) * 1e3, statistics.median(times[(2, b)]) * 1e3
        steps = args.steps * len(comm[b])
        total = {k: sum(c.get(k, 0) for c in comm[b]) for k in comm[b][0]}
        per = {k: v / steps for k, v in total.items()}
        print(f"{b:>5} {t1:>9.2f} {t2:>9.2f} {t2 / t1:>8.2f} {per.get('all_reduce_seconds', 0) * 1e3:>14.2f} "
              f"{per.get('all_reduce_calls', 0):>6.0f} {per.get('all_gather_seconds', 0) * 1e3:>14.2f} "
              f"{per.get('broadcast_seconds', 0) * 1e3:>13.3f} {per.get('all_reduce_bytes', 0) / 1024:>16.1f}")
    print("collective times are rank 0's: the transfer plus the wait for rank 1 to reach the same collective")
    torch.set_num_threads(1)
    for b in batches:
        alone = gloo_allreduce_seconds(b * model.hidden_size)
        print(f"gloo all-reduce of [{b}, {model.hidden_size}] fp32 between two idle processes: {alone * 1e6:.0f} us "
              f"(x {2 * model.num_layers} per step = {2 * model.num_layers * alone * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
