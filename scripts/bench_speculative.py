"""Speculative decoding benchmark: what a (1 + k)-token verify step costs, and tokens/s with and without ngram.

``--verify-cost``: engine time of one step where each of ``batch`` decoding sequences feeds 1 + k tokens
(its last token and k proposals), against the plain 1-token decode step, k = 1..8, batch 1 and 4. The ratio
bounds the achievable speedup: a step that emits a tokens on average is a / ratio(k) times faster.

Default: the same run measures tokens/s of greedy generation through ``LLM`` with and without
``speculative_config={"method": "ngram", ...}``, single stream and batch 4 / 16, on (a) a copy-heavy workload
(the prompt holds a passage and asks for it again: the model's continuation repeats text it has seen) and (b)
plain text (prompts without repeats), and prints each ratio (median of --rounds alternated runs) and the
acceptance rates. "same" counts the requests whose tokens equal the run without speculation: in bf16 a step's
numerics depend on its shapes (a 1 + k-token GEMM rounds differently from a 1-token GEMV, and batch composition
changes them too), so a random model's near-tied argmaxes can flip; the fp32 tests check exact equality.

The checkpoint is synthetic_checkpoints' 246m Llama (random weights, created once under work/bench). A random
model's greedy output settles into loops, which is what an n-gram proposer feeds on: the copy-heavy workload is
built from the model's own greedy continuation (the prompt holds it twice, and the request continues it).
``--trained STEPS`` fits the checkpoint to the synthetic corpus first (the demo's kind of model) and takes both
workloads from windows of its training stream (the corpus repeated): copy-heavy = a window longer than the corpus,
so that what the model continues with is text the prompt holds; plain = a window whose continuation it does not
hold. The fit uses windows as long as a run's sequences (``--train-len``): a model predicts its text only at the
positions it was fitted on. (The first version's copy-heavy prompt, a window and its first 8 tokens again, was a
jump the fitted model had never seen: it continued the window's stream, not the repeat, and acceptance measured
where the two happened to agree.)

``--methods ngram,draft_model`` measures both proposers in the same run, against the same baseline: the draft is
the ``--draft-size`` Llama (default ``small-draft``, ~4.4x smaller than ``small``), fitted to the same corpus for
the same steps, so it shares the target's tokenizer. By default each method's k is the adaptive policy's
(``kiln.runtime.spec_policy``: from measured costs and acceptance); ``--disable-by-batch-size N`` sets the hard
cap of every method, ``--fixed-k`` turns the policy off (always k: the batch crossover without adaptation is
``--methods ngram --batches 1,2,3,4 --fixed-k``).
Each speculating row prints its acceptance per draft position.

``--breakdown``: where the time of the batch-1 runs goes, by step kind (the prefill step, plain decode steps, verify
steps by k): steps, median engine ms, median ms of the whole step (schedule to the next step's start: sampling or
verification, the books, emission, the proposer), tokens each emits, and each kind's share of the run. It says what
bounds the ratio: a verify step at k that costs c(k) plain steps and emits t(k) tokens gains t(k) / c(k) on its
share of the run, and the prefill's share gains nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

from bench_common import ensure_checkpoint, ensure_engine, log

K_VALUES = (1, 2, 3, 4, 6, 8)
PROMPT_LEN = 128   # tokens of the random model's prompts; the most of a corpus model's plain prompt
OVERLAP = 48       # tokens a corpus model's copy-heavy prompt runs past one corpus period


def build_config(dtype: str, backend: str) -> dict:
    return dict(dtype=dtype, backend=backend, max_batch_size=16, max_input_len=1024, max_seq_len=1536,
                max_num_tokens=2048)


def verify_cost(engine_dir, batches=(1, 4), context: int = 256, steps: int = 20) -> None:
    """Median engine time of (1 + k)-token steps vs 1-token steps for decoding sequences."""
    from kiln.contract import SeqChunk, pack_inputs
    from kiln.runtime import Engine

    engine = Engine.from_dir(engine_dir)
    bs = engine.config.bounds.tokens_per_block
    per_seq = (context + 16) // bs + 1
    kv = engine.allocate_kv_cache(max(batches) * per_seq + 1)
    vocab = engine.config.model.vocab_size
    gen = torch.Generator().manual_seed(0)

    def step_time(batch: int, n: int) -> float:
        chunks = []
        for s in range(batch):
            blocks = list(range(1 + s * per_seq, 1 + (s + 1) * per_seq))
            ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
            chunks.append(SeqChunk(ids, context, blocks, n))
        inputs = pack_inputs(chunks, kv, bs)
        t0 = time.perf_counter()
        engine.run(inputs)
        return time.perf_counter() - t0

    print(f"\nverify cost: engine ms per step, {context} tokens of context, median of {steps} steps")
    print(f"{'batch':>5} {'tokens/seq':>10} {'ms/step':>9} {'vs 1 token':>10}")
    for batch in batches:
        base = None
        for n in (1, *[1 + k for k in K_VALUES]):
            if batch * n > engine.config.bounds.max_num_logits:
                continue   # more logits rows than the engine returns (the scheduler never asks for them)
            for _ in range(3):
                step_time(batch, n)
            med = statistics.median(step_time(batch, n) for _ in range(steps)) * 1e3
            base = base or med
            print(f"{batch:>5} {n:>10} {med:>9.2f} {med / base:>9.2f}x", flush=True)


def greedy_continuation(llm, prompt: list[int], n: int) -> list[int]:
    from kiln.runtime import SamplingParams

    return llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].token_ids


def workloads(llm, vocab: int, count: int, prompt_len: int) -> dict[str, list[list[int]]]:
    """copy-heavy: a passage (the model's own continuation of a random start) twice, then its first tokens
    again; plain: random tokens (no repeats for the proposer to find in the prompt)."""
    gen = torch.Generator().manual_seed(1)
    plain = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(count)]
    copy = []
    for p in plain:
        start = p[: prompt_len // 4]
        passage = start + greedy_continuation(llm, start, prompt_len // 4)
        copy.append(passage + passage + passage[:8])
    return {"copy-heavy": copy, "plain": plain}


def corpus_workloads(ckpt, count: int, max_tokens: int) -> dict[str, list[list[int]]]:
    """For a corpus-trained checkpoint (``--trained``), windows of the training stream (the corpus repeated, so a
    fitted model continues each window with the stream's next tokens): copy-heavy = one corpus period plus 48
    tokens, so what follows the window is text the window already holds (a document whose answer repeats it, as
    in summarising or editing; what the n-gram proposer is for); plain = a window short enough that neither it nor
    the generated text reaches the next period (its continuation is corpus text the prompt does not hold)."""
    from tokenizers import Tokenizer

    from synthetic_checkpoints import corpus_period, corpus_token_ids

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    ids, period = corpus_token_ids(tok), corpus_period(tok)
    plain_len = min(PROMPT_LEN, period - max_tokens)
    if ids[period: 2 * period] != ids[:period] or plain_len < 16 or max_tokens > period:
        raise SystemExit(f"--max-tokens {max_tokens}: the corpus period ({period} tokens) leaves no copy-free plain "
                         f"prompt of 16 tokens or more (or the stream does not repeat it); use at most "
                         f"{period - 16}")
    copy_len = period + OVERLAP
    stride = max(1, (len(ids) - copy_len - max_tokens) // count)
    return {"copy-heavy": [ids[i * stride: i * stride + copy_len] for i in range(count)],
            "plain": [ids[i * stride: i * stride + plain_len] for i in range(count)]}


def corpus_train_len(size: str, max_tokens: int) -> int:
    """Tokens per training window that cover a copy-heavy run's sequences (its prompt plus ``max_tokens``): a
    model predicts its text at the positions it was fitted on (fitted on 64-token windows, the small Llama missed
    1 token in 10 past position 96, and its continuations then left the text)."""
    from synthetic_checkpoints import corpus_period, hf_config, train_tokenizer

    return corpus_period(train_tokenizer(hf_config("llama", size).vocab_size)) + OVERLAP + max_tokens


def run_case(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from kiln.runtime import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / elapsed, outs


def spec_counts(llm) -> dict:
    return dict(llm.stats().get("speculative", {}))


def spec_delta(before: dict, after: dict, into: dict) -> None:
    """Add what the speculative counters gained between two ``stats()["speculative"]`` snapshots to ``into``
    (proposed, accepted, verify steps, [proposed, accepted] per draft position): the counters are the executor's,
    shared by the methods, so each method's runs are counted around them."""
    for key in ("proposed_tokens", "accepted_tokens", "verify_steps"):
        into[key] = into.get(key, 0) + after.get(key, 0) - before.get(key, 0)
    old, pos = before.get("counts_per_position", []), into.setdefault("per_position", [])
    for j, (p, a) in enumerate(after.get("counts_per_position", [])):
        p0, a0 = old[j] if j < len(old) else (0, 0)
        if j == len(pos):
            pos.append([0, 0])
        pos[j][0] += p - p0
        pos[j][1] += a - a0


def breakdown(llm, proposer, prompts: list[list[int]], max_tokens: int, rounds: int) -> None:
    """Print the step-kind table of ``--breakdown`` for the baseline and the speculating runs of ``prompts``."""
    from bench_decode import StepTimers

    ex = llm.executor
    timers = StepTimers(ex)
    update = ex.scheduler.update_from_output

    def counted(out, sampled, accepted=None):   # what kind of step this was, and the tokens it emitted
        new = update(out, sampled, accepted)
        timers._cur.update(k=out.num_spec_tokens, emitted=len(new), prefill=out.num_prefill_tokens)
        return new

    ex.scheduler.update_from_output = counted
    steps: dict = {None: [], "spec": []}
    for _ in range(rounds):
        for method in (None, "spec"):
            ex.wait_idle()
            ex.proposer = proposer if method else None
            timers.reset()
            run_case(llm, prompts, max_tokens)
            ex.wait_idle()
            steps[method] += timers.steps
    print(f"\nbreakdown, batch {len(prompts)}, {rounds} runs each: ms per step (median), tokens per step (mean)")
    print(f"{'run':<6} {'step kind':<12} {'steps':>6} {'engine ms':>9} {'step ms':>8} {'vs plain':>8} {'tok/step':>8} "
          f"{'share':>6}")
    for method, st in steps.items():
        kinds: dict = {}
        for s in st:
            kind = "prefill" if s.get("prefill") else ("plain" if not s.get("k") else f"verify k={s['k']}")
            kinds.setdefault(kind, []).append(s)
        whole = sum(s["total"] + s["since_last"] for s in st)
        plain = None
        for kind in sorted(kinds, key=lambda k: (k != "prefill", k != "plain", k)):
            ks = kinds[kind]
            step = 1e3 * statistics.median(s["total"] + s["since_last"] for s in ks)
            plain = step if kind == "plain" else plain
            share = sum(s["total"] + s["since_last"] for s in ks) / whole
            print(f"{'base' if method is None else 'ngram':<6} {kind:<12} {len(ks):>6} "
                  f"{1e3 * statistics.median(s['engine'] for s in ks):>9.2f} {step:>8.2f} "
                  f"{step / plain if plain and kind != 'prefill' else float('nan'):>7.2f}x "
                  f"{statistics.mean(s['emitted'] for s in ks):>8.2f} {share:>6.1%}", flush=True)
    ex.scheduler.update_from_output = update


def spec_configs(args) -> dict[str, dict]:
    """The speculative_config of each method asked for (``--spec`` replaces the ngram one)."""
    configs = {}
    for method in args.methods.split(","):
        if method == "ngram":
            configs[method] = json.loads(args.spec) if args.spec else {
                "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        elif method == "draft_model":
            configs[method] = {"method": "draft_model", "num_speculative_tokens": args.k}
        else:
            raise SystemExit(f"--methods: unknown method {method!r} (ngram, draft_model)")
        if args.disable_by_batch_size is not None:
            configs[method]["disable_by_batch_size"] = args.disable_by_batch_size
        if args.fixed_k:
            configs[method]["adaptive"] = False
    return configs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="246m", help="synthetic_checkpoints preset of the Llama (default 246m)")
    ap.add_argument("--draft-size", default="small-draft", help="preset of the draft_model method's Llama")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="cpu-compiled")
    ap.add_argument("--verify-cost", action="store_true", help="only the (1 + k)-token step cost table")
    ap.add_argument("--methods", default="ngram", help="comma-separated: ngram, draft_model")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--spec", default=None, help="the ngram method's speculative_config JSON (overrides --k)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="every method's disable_by_batch_size hard cap (default: none)")
    ap.add_argument("--fixed-k", action="store_true", help="adaptive off: every step proposes k (within the rows)")
    ap.add_argument("--trained", type=int, default=0, metavar="STEPS",
                    help="fit the checkpoint to the synthetic corpus for STEPS steps and take the workloads from "
                         "that corpus (a model that predicts its text, as the demo's; default: random weights)")
    ap.add_argument("--train-len", type=int, default=0, metavar="TOKENS",
                    help="--trained's window length (default: the copy-heavy prompt plus --max-tokens, so the "
                         "model has been fitted at every position the runs use)")
    ap.add_argument("--rounds", type=int, default=3, help="base / spec runs alternated, the median rate kept")
    ap.add_argument("--breakdown", action="store_true",
                    help="only the step-kind table of the batch-1 runs (ngram), for each workload")
    args = ap.parse_args()
    from kiln.runtime import LLM
    from kiln.runtime.speculative import NgramProposer, SpeculativeConfig

    train_len = args.train_len or (corpus_train_len(args.size, args.max_tokens) if args.trained else 64)
    ckpt = ensure_checkpoint(args.size, args.trained, train_len)
    tag = ckpt.name.removeprefix(f"llama-{args.size}")
    build = build_config(args.dtype, args.backend)
    engine_dir = ensure_engine(f"llama-{args.size}{tag}-{args.dtype}-{args.backend}-spec", build, ckpt)
    if args.verify_cost:
        verify_cost(engine_dir)
        return
    configs = spec_configs(args)
    if "draft_model" in configs:
        draft_ckpt = ensure_checkpoint(args.draft_size, args.trained, train_len)
        draft_dir = ensure_engine(f"llama-{args.draft_size}{tag}-{args.dtype}-{args.backend}-spec", build, draft_ckpt)
        configs["draft_model"]["model"] = str(draft_dir)
    batches = [int(b) for b in args.batches.split(",")]
    # one LLM, its proposer switched between the methods and off for the baseline: two LLMs in one process are two
    # step-loop threads with an OpenMP team each, and libgomp then sleeps between parallel regions (see
    # kiln.runtime.executor), which cost the second one ~10% in a first version of this script. The LLM is made
    # with the draft model's config when there is one (its pool is allocated then); ngram's proposer is made here.
    llm = LLM(str(engine_dir), max_kv_cache_tokens=65536,
              speculative_config=configs.get("draft_model", configs.get("ngram")))
    proposers = {m: (llm.executor.proposer if m == llm.executor.config.speculative_config.method
                     else NgramProposer(SpeculativeConfig(**c))) for m, c in configs.items()}

    def mode(method: str | None):
        llm.executor.wait_idle()
        llm.executor.proposer = proposers.get(method)
        return llm

    loads = (corpus_workloads(ckpt, max(batches), args.max_tokens) if args.trained
             else workloads(mode(None), llm.executor.vocab_size, max(batches), PROMPT_LEN))
    if args.breakdown:
        for name, prompts in loads.items():
            print(f"\n{name}:")
            run_case(mode("ngram"), prompts[:1], 4)
            breakdown(llm, proposers["ngram"], prompts[:1], args.max_tokens, args.rounds)
        return
    print(f"\n{datetime.date.today()} llama {args.size}{tag} {args.dtype} {args.backend}, {torch.get_num_threads()} "
          f"threads; greedy, {args.max_tokens} new tokens")
    for method, config in configs.items():
        print(f"  {method}: speculative_config={json.dumps(config)}")
    print(f"{'method':<11} {'workload':<11} {'batch':>5} {'base tok/s':>10} {'spec tok/s':>10} {'ratio':>6} "
          f"{'accept':>7} {'tok/step/seq':>12} {'same':>6}  accepted per position")
    for name, prompts in loads.items():
        for batch in batches:
            ps = prompts[:batch]
            for method in (None, *configs):   # warm every mode
                run_case(mode(method), ps[:1], 4)
            rates: dict = {m: [] for m in (None, *configs)}
            counts: dict = {m: {} for m in configs}
            outs: dict = {}
            for _ in range(args.rounds):   # alternated: base, then each method
                for method in (None, *configs):
                    before = spec_counts(mode(method))
                    rate, outs[method] = run_case(mode(method), ps, args.max_tokens)
                    rates[method].append(rate)
                    if method is not None:
                        spec_delta(before, spec_counts(llm), counts[method])
            b_rate = statistics.median(rates[None])
            for method in configs:
                s_rate = statistics.median(rates[method])
                c = counts[method]
                prop, acc, steps = c["proposed_tokens"], c["accepted_tokens"], c["verify_steps"]
                per_pos = [round(a / p, 2) for p, a in c["per_position"] if p]
                same = sum(a.token_ids == b.token_ids for a, b in zip(outs[None], outs[method]))
                print(f"{method:<11} {name:<11} {batch:>5} {b_rate:>10.1f} {s_rate:>10.1f} {s_rate / b_rate:>5.2f}x "
                      f"{acc / prop if prop else 0:>6.1%} {(acc + steps) / steps if steps else 1:>12.2f} "
                      f"{same:>3}/{len(ps)}  {per_pos}", flush=True)
    log("done")


if __name__ == "__main__":
    main()
