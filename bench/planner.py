"""Capacity planner: KV pool, concurrency, step time and instances for an engine, a device and a workload.

Memory. ``available`` = device memory - the weights one device holds (what the runtime's
``kv_cache_memory_fraction`` applies to: the memory free once the engine is loaded). With tensor parallelism
(kiln's layout, ``kiln.contract.TensorParallelMapping``) a device holds 1 / tp of the layers and of the LM
head, the whole embedding table (and, for tied embeddings, its LM head slice besides), and its KV heads:
``max(kv_heads / tp, 1)`` of them (fewer KV heads than devices are replicated, as the builder does).
The pool is sized by ``kiln.runtime.executor.resolve_serving_limits``, the function the executor itself
calls, so the planner's block count is the runtime's for the same options (tests/test_bench_plan.py checks
it against ``LLM``).

Concurrency. A request holds ``ceil((prompt + output - 1) / tokens_per_block)`` blocks at its longest
(the scheduler's ``blocks_for_request``); at a percentile's lengths the pool holds ``num_blocks // that``
sequences: ``min(that at P95, max_batch_size)`` is what is guaranteed to run at once (the recommended
max_batch_size). Queues form on average earlier or later than that: at ``min(num_blocks / mean blocks
per request - 1, max_batch_size)`` running sequences (blocks: the reservation under guaranteed_no_evict,
about prompt + output / 2 under max_utilization, where it shows as preemption; - 1: the request at the
head of the queue needs room for its own blocks).

Step time (per device, additive: the memory and compute phases of kiln's kernels do not overlap much,
and ``a + b x tokens`` is what ``--calibration`` fits):
    t_step = (streamed weights / tp + KV bytes read per device) / bandwidth
    (an MoE model streams the experts its tokens choose: a batch of B reads 1 - (1 - top_k / E)^B of them,
    the matmul parameters are one token's: its top_k experts and the router)
           + (2 x matmul params / tp x tokens + 2 x lm_head params / tp x sequences + attention FLOPs / tp) / FLOP/s
           + t_allreduce + t_allgather
    t_allreduce = layers x 2 x [2 (tp - 1) / tp x tokens x hidden x activation bytes / link bandwidth
                                + 2 (tp - 1) x 5 us]       (two ring all-reduces of the hidden state per layer:
                                                            after the row-parallel o_proj and down_proj)
    t_allgather = (tp - 1) / tp x sequences x vocab x activation bytes / link bandwidth + (tp - 1) x 5 us
                                                           (the vocab-parallel LM head's logits, once per step)
    attention FLOPs = 4 x layers x heads x head_dim x context, per token.
Per token and layer the all-reduces move 2 x 2 (tp - 1) / tp x hidden x activation bytes through each device's
link (Llama-3-8B, bf16, tp 2: 16 KiB); per sampled sequence the gather moves (tp - 1) / tp x vocab x activation
bytes (128256 x 2 B / 2: 125 KiB). The runtime's step broadcast of the inputs (8 bytes per token and per block
table entry, host side) is not modelled: it is on the CPU, beside the launch of the step.
The pure roofline ``max(bytes / bandwidth, FLOPs / peak)`` is printed too (a lower bound).

Load (a mean-value model, steady state at rate L per instance): every step carries the decodes of the
requests in flight and a share of prefill tokens, so t_step = A / (1 - L x K), with A the fixed cost of a
step and K the engine time each request adds (its prompt and output tokens, KV reads and attention).
1 / K is the saturation rate. TPOT ~ t_step; TTFT(P) ~ t_step / 2 + ceil(P / chunk) x t_step + P x per-token
cost; concurrency by Little's law N = L x (TTFT + (output - 1) x TPOT). Queueing starts at the first of two
rates: N reaches the concurrency limit, or the tokens arriving per step, L x (prompt + output) x t_step,
fill max_num_tokens. The SLO rate is the highest rate below the onset with TTFT(P95 prompt) and TPOT
within the SLO; instances = ceil(rate / SLO rate). Mean values: bursts make real queues appear earlier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kiln.bench.devices import Device
from kiln.bench.engine_facts import EngineFacts
from kiln.bench.serving_knobs import recommend_token_budget
from kiln.contract import BuildConfigError, ModelConfig, TensorParallelMapping
from kiln.runtime.draft_model import draft_pool_blocks
from kiln.runtime.executor import ExecutorConfig, resolve_serving_limits
from kiln.runtime.kv_cache import cdiv

if TYPE_CHECKING:
    from kiln.bench.spec_plan import SpeculationInputs

ALLREDUCE_HOP_S = 5e-6
_ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}


class PlanError(ValueError):
    """The engine cannot be served as planned (e.g. the weights do not fit); the message says why."""


@dataclass
class WorkloadStats:
    """Prompt and output lengths at the percentiles the planner uses, and where they came from."""

    prompt: dict           # mean, p50, p90, p95
    output: dict
    total: dict            # of prompt + output per request
    prompt_sq_mean: float  # E[prompt^2], for prefill attention
    source: str
    lengths: list[tuple[float, float]] = field(default_factory=list)   # (prompt, output) per request

    def mean_blocks(self, block: int, capacity_policy: str) -> float:
        """KV blocks a request holds on average over the workload: its whole reservation
        ceil((prompt + output - 1) / block) under guaranteed_no_evict; under max_utilization the blocks
        grow with the output, about ceil((prompt + output / 2) / block) over its life."""
        if capacity_policy == "max_utilization":
            return float(np.mean([cdiv(int(math.ceil(p + o / 2)), block) for p, o in self.lengths]))
        return float(np.mean([cdiv(int(math.ceil(p + o)) - 1, block) for p, o in self.lengths]))

    @classmethod
    def from_lengths(cls, prompts, outputs, source: str) -> WorkloadStats:
        p, o = np.asarray(prompts, dtype=float), np.asarray(outputs, dtype=float)

        def stats(x):
            return {"mean": float(x.mean()), **{f"p{q}": float(np.percentile(x, q)) for q in (50, 90, 95)}}

        return cls(stats(p), stats(o), stats(p + o), float((p**2).mean()), source, list(zip(p.tolist(), o.tolist())))

    @classmethod
    def from_percentiles(cls, context_p95: int, output_p95: int, context_mean: float | None = None,
                         output_mean: float | None = None) -> WorkloadStats:
        pm = context_mean if context_mean is not None else context_p95
        om = output_mean if output_mean is not None else output_p95
        p = {"mean": pm, "p50": pm, "p90": context_p95, "p95": context_p95}
        o = {"mean": om, "p50": om, "p90": output_p95, "p95": output_p95}
        t = {k: p[k] + o[k] for k in p}
        src = f"--context-p95 {context_p95} --output-p95 {output_p95}" + (
            "" if context_mean is not None else " (means taken = p95: conservative)")
        return cls(p, o, t, float(pm**2), src, [(pm, om)])


def _v(value, source: str, unit: str = "") -> dict:
    return {"value": value, "unit": unit, "source": source}


def allreduce_seconds(layers: int, hidden: int, elem_bytes: int, tokens: float, tp: int,
                      link_bandwidth: float) -> float:
    """Tensor-parallel communication of one step: 2 ring all-reduces of the [tokens, hidden] activations per
    layer (after attention and after the MLP); a ring moves 2 (tp - 1) / tp of the data through each link
    and takes 2 (tp - 1) hops of latency ALLREDUCE_HOP_S."""
    if tp == 1:
        return 0.0
    per = 2 * (tp - 1) / tp * tokens * hidden * elem_bytes / link_bandwidth + 2 * (tp - 1) * ALLREDUCE_HOP_S
    return layers * 2 * per


def allgather_seconds(vocab: int, elem_bytes: int, seqs: float, tp: int, link_bandwidth: float) -> float:
    """The vocab-parallel LM head's ring all-gather of one step's logits rows (``vocab`` padded to a multiple
    of tp, in the activation dtype): (tp - 1) / tp of them pass each link, in tp - 1 hops."""
    if tp == 1:
        return 0.0
    return (tp - 1) / tp * seqs * vocab * elem_bytes / link_bandwidth + (tp - 1) * ALLREDUCE_HOP_S


def tp_mapping(facts: EngineFacts, tp: int) -> TensorParallelMapping:
    """kiln's split of the model over ``tp`` devices (PlanError naming the numbers when the builder would refuse)."""
    model = ModelConfig(architecture=facts.architecture, vocab_size=facts.vocab_size, hidden_size=facts.hidden_size,
                        intermediate_size=facts.intermediate_size, num_layers=facts.num_layers,
                        num_heads=facts.num_heads, num_kv_heads=facts.num_kv_heads, head_dim=facts.head_dim,
                        max_position_embeddings=facts.bounds.max_seq_len)
    try:
        return TensorParallelMapping.plan(model, tp, build_id="")
    except BuildConfigError as exc:
        raise PlanError(str(exc)) from None


def device_share(facts: EngineFacts, mapping: TensorParallelMapping) -> tuple[float, float, int]:
    """(weights, streamed weights, KV bytes per token) one device holds under ``mapping``."""
    tp = mapping.tp_size
    if facts.tp_size > 1 or tp == 1:   # a tensor-parallel engine's facts are one rank's already
        return facts.weights_bytes, facts.streamed_weight_bytes, facts.kv_bytes_per_token
    table = facts.embedding_bytes      # whole on every device; a tied LM head is a slice of it besides
    weights = (facts.weights_bytes - table) / tp + table + (table / tp if facts.tie_word_embeddings else 0)
    kv = facts.kv_bytes_per_token * mapping.num_kv_heads_per_rank // facts.num_kv_heads
    return weights, facts.streamed_weight_bytes / tp, kv


def experts_read(share: float, tokens: float) -> float:
    """The expected share of an MoE layer's experts that ``tokens`` tokens read, each choosing ``share`` of them
    (independent choices): 1 - (1 - share)^tokens; ``share`` for one token, 1 for a dense model."""
    return 1.0 - (1.0 - share) ** max(tokens, 1.0)


def plan(facts: EngineFacts, device: Device, workload: WorkloadStats, *, tp: int | None = None,
         max_batch_size: int | None = None, max_num_tokens: int | None = None,
         kv_cache_memory_fraction: float | None | str = "recommended", max_kv_cache_tokens: int | None = None,
         available_bytes: int | None = None, headroom: float = 0.10, percentile: int = 95,
         calibration: dict | None = None, rate: float | None = None, slo_ttft_p95: float | None = None,
         slo_tpot_p95: float | None = None, capacity_policy: str = "guaranteed_no_evict", max_loras: int = 4,
         pd_transport=None, pd_max_workers: int = 64, speculation: SpeculationInputs | None = None) -> dict:
    """The plan: every number as {"value", "unit", "source"} under a few headings.

    Serving options mean what they mean to ``LLM(...)``, except ``kv_cache_memory_fraction``, which defaults
    to the recommended fraction instead of the runtime's 0.9 (None: no memory limit, as in ExecutorConfig).
    ``tp`` None: the engine's tensor-parallel size (1 for a model not built yet). ``pd_transport``
    (``pd_plan.Transport``): also plan prefill and decode workers (``pd_plan``) from this step-time model, under
    ``out["pd"]``. ``speculation``: the memory of a draft model and the speed of speculating (``spec_plan``),
    under ``out["speculative"]``.
    """
    if tp is None:
        tp = facts.tp_size
    if tp < 1:
        raise PlanError(f"--tp must be >= 1, got {tp}")
    if facts.tp_size > 1 and tp != facts.tp_size:
        raise PlanError(f"the engine was built for {facts.tp_size} tensor-parallel ranks: plan it with --tp "
                        f"{facts.tp_size} (plan its one-rank build or --hf-config for another --tp)")
    mapping = tp_mapping(facts, tp)
    b = facts.bounds
    block = b.tokens_per_block
    weights_dev, streamed_dev, kv_dev = device_share(facts, mapping)
    out: dict = {"inputs": {}, "memory": {}, "concurrency": {}, "settings": {}, "step_time": {}, "load": {}}
    inp = out["inputs"]
    inp["engine"] = _v(facts.name, "--engine / --hf-config")
    inp["device"] = _v(device.name, device.source)
    inp["tp"] = _v(tp, "--tp")
    if facts.total_params:
        moe = (f"; {facts.active_params / 1e9:.3f}B active per token ({facts.expert_share:.0%} of the experts)"
               if facts.expert_share < 1 else "")
        inp["parameters"] = _v(f"{facts.total_params / 1e9:.3f}B{moe}", facts.origin.get("parameters", "model shape"))
    inp["kv_cache_dtype"] = _v(facts.kv_cache_dtype, facts.origin.get("kv_cache_dtype", ""))
    inp["workload"] = _v({"prompt": workload.prompt, "output": workload.output}, workload.source, "tokens")

    mem = out["memory"]
    if available_bytes is None:
        available_bytes = int(device.memory_bytes - weights_dev)
        avail_src = f"device memory {device.memory_bytes / 2**30:.2f} GiB ({device.source}) - weights per device"
    else:
        avail_src = "given (memory free after the engine is loaded)"
    mem["device_memory"] = _v(device.memory_bytes, device.source, "B")
    per_tp = f" / tp {tp}" if tp > 1 and facts.tp_size == 1 else ""
    weights_src = (f" split over tp {tp}: (weights - embedding table) / tp + the embedding table"
                   + (" + its tied LM head slice" if facts.tie_word_embeddings else "")) if per_tp else ""
    mem["weights_per_device"] = _v(int(weights_dev), facts.origin.get("weights_bytes", "") + weights_src, "B")
    mem["activation_peak"] = _v(facts.activation_peak_bytes, facts.origin.get("activation_peak_bytes", "")
                                + (" (not divided by tp: hidden states are replicated)" if tp > 1 else ""), "B")
    if facts.lora_slot_bytes:   # the runtime takes the adapter pool out of what the KV pool is sized from
        pool = max_loras * facts.lora_slot_bytes
        mem["lora_adapter_pool"] = _v(pool, f"max_loras {max_loras} x {facts.lora_slot_bytes} B per slot ("
                                      + facts.origin.get("lora_slot_bytes", "") + ")", "B")
        available_bytes -= pool
        avail_src += " - the LoRA adapter pool"
    draft = speculation.draft if speculation is not None else None
    if draft is not None:   # the runtime loads the draft before it measures what the pools may take
        if tp > 1:
            raise PlanError("a draft model is planned on one device only (--tp 1)")
        available_bytes -= draft.weights_bytes
        avail_src += " - the draft's weights"
    mem["available_after_weights"] = _v(available_bytes, avail_src, "B")
    if available_bytes <= facts.activation_peak_bytes:
        raise PlanError(f"the weights ({weights_dev / 2**30:.2f} GiB per device) leave "
                        f"{available_bytes / 2**30:.2f} GiB: "
                        f"not even the activations ({facts.activation_peak_bytes / 2**30:.2f} GiB) fit; use a larger "
                        "device, quantize the weights or raise --tp")
    recommended_fraction = math.floor(100 * (available_bytes * (1 - headroom) - facts.activation_peak_bytes)
                                      / available_bytes) / 100
    if kv_cache_memory_fraction == "recommended":
        fraction, frac_src = recommended_fraction, (f"recommended: (available x (1 - {headroom:g} headroom) - "
                                                    "activation peak) / available, rounded down")
    else:
        fraction, frac_src = kv_cache_memory_fraction, "given" if kv_cache_memory_fraction is not None else "none given"
    cfg = ExecutorConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                         kv_cache_memory_fraction=fraction, max_kv_cache_tokens=max_kv_cache_tokens)
    try:
        # with a draft, one budget for both pools, split by bytes per token (as the executor sizes them)
        limits = resolve_serving_limits(b, kv_dev + (draft.kv_bytes_per_token if draft else 0), cfg,
                                        available_bytes=available_bytes)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    pool_src = "kiln.runtime.executor.resolve_serving_limits (the executor's own sizing): " + limits.kv_plan
    mem["kv_cache_memory_fraction"] = _v(fraction, frac_src)
    kv_src = (f" x {mapping.num_kv_heads_per_rank} of {facts.num_kv_heads} KV heads per device"
              + (f" (each replicated on {mapping.kv_head_replicas})" if mapping.kv_head_replicas > 1 else "")
              if per_tp else "")
    mem["kv_bytes_per_token_per_device"] = _v(kv_dev, facts.origin.get("kv_bytes_per_token", "") + kv_src, "B")
    mem["kv_pool_blocks"] = _v(limits.num_blocks, pool_src, "blocks")
    mem["kv_pool_tokens"] = _v(limits.num_blocks * block, f"blocks x tokens_per_block {block}", "tokens")
    mem["kv_pool_bytes"] = _v(limits.num_blocks * block * kv_dev, "tokens x KV bytes per token per device", "B")
    if draft is not None:
        from kiln.bench.spec_plan import draft_memory

        draft_memory(mem, draft, draft_pool_blocks(limits.num_blocks, block, draft.bounds))
    if fraction is not None and available_bytes * (1 - fraction) < facts.activation_peak_bytes:
        left = available_bytes * (1 - fraction) / 2**20
        mem["warning"] = _v(f"kv_cache_memory_fraction {fraction} leaves {left:.0f} MiB, "
                            f"less than the activation peak {facts.activation_peak_bytes / 2**20:.0f} MiB: "
                            f"use <= {recommended_fraction}", "memory check")

    conc = out["concurrency"]
    per_q = {}
    for q in ("p50", "p90", "p95"):
        p, o = workload.prompt[q], workload.output[q]
        blocks = cdiv(int(math.ceil(p + o)) - 1, block)
        seqs = limits.num_blocks // max(blocks, 1)
        per_q[q] = min(seqs, limits.max_batch_size)
        conc[f"kv_sequences_at_{q}"] = _v(seqs, f"pool blocks {limits.num_blocks} // ceil(({p:g} prompt + {o:g} output "
                                                f"- 1) / {block}) = {blocks} blocks per sequence", "sequences")
    key = f"p{percentile}"
    limit = per_q[key]
    conc["max_concurrent_sequences"] = _v(limit, f"min(KV sequences at {key} lengths, max_batch_size "
                                                 f"{limits.max_batch_size}): beyond it requests queue or are preempted",
                                          "sequences")
    conc["limited_by"] = _v("KV cache" if limit < limits.max_batch_size else "max_batch_size", "the smaller of the two")
    mean_blocks = workload.mean_blocks(block, capacity_policy)
    # admission needs room for the next request's own blocks too: on average queues form once the running
    # requests hold the pool less one request's worth
    kv_mean = max(limits.num_blocks / mean_blocks - 1, 1.0)
    onset_limit = min(kv_mean, limits.max_batch_size)
    conc["kv_sequences_at_mean_occupancy"] = _v(kv_mean, f"pool blocks {limits.num_blocks} / {mean_blocks:.2f} "
                                                         "blocks a "
                                                         f"request holds on average ({capacity_policy}), less the one "
                                                         "waiting for room", "sequences")
    conc["queueing_concurrency"] = _v(onset_limit, "min(KV sequences at mean occupancy, max_batch_size): where queues "
                                                   "form on average (the p-percentile limit above is what is "
                                                   "guaranteed)", "sequences")

    st = out["settings"]
    blocks_at_key = max(cdiv(int(math.ceil(workload.total[key])) - 1, block), 1)
    rec_batch = max(1, min(b.max_batch_size, limits.num_blocks // blocks_at_key))
    st["max_batch_size"] = _v(rec_batch, f"sequences the pool holds at {key} prompt + output (no preemption at those "
                                         f"lengths), at most the engine's {b.max_batch_size}")
    st["kv_cache_memory_fraction"] = _v(recommended_fraction, f"leaves {headroom:.0%} headroom + the activation peak")

    # ---- step time model
    if calibration:
        bw = calibration["bandwidth_bytes_per_s"]
        fl = calibration["flops_per_s"]
        rate_src = (f"measured by kiln bench ({calibration.get('source')}; "
                    f"fit {calibration['step_fixed_s'] * 1e3:.2f} ms/step "
                    f"+ {calibration['per_token_s'] * 1e3:.3f} ms/token, R^2 {calibration['r2']:.2f})")
        bw_src = fl_src = rate_src
    else:
        bw, fl = device.bandwidth, device.flops_for(facts.dtype)
        bw_src = fl_src = f"roofline: {device.source}"
    elem = _ELEM.get(facts.dtype, 4)
    link = device.link_bandwidth
    hd = facts.num_heads * facts.head_dim

    def allreduce(tokens: float, seqs: float) -> float:
        """Tensor-parallel communication of a step: the all-reduces of the hidden states and the logits gather."""
        if tp > 1 and link is None:
            raise PlanError(f"device {device.name} has no interconnect figure for --tp {tp}")
        return (allreduce_seconds(facts.num_layers, facts.hidden_size, elem, tokens, tp, link or 0.0)
                + allgather_seconds(mapping.vocab_size_per_rank * tp, elem, seqs, tp, link or 0.0))

    # an MoE step reads the experts its tokens chose: streamed_dev holds one token's share of them
    expert_dev = facts.expert_bytes / (tp if facts.tp_size == 1 else 1)

    def streamed(tokens: float) -> float:
        return streamed_dev + expert_dev * (experts_read(facts.expert_share, tokens) - facts.expert_share)

    def t_mem(kv_tokens: float, tokens: float = 1) -> float:
        return (streamed(tokens) + kv_tokens * kv_dev) / bw

    def t_compute(tokens: float, seqs: float, ctx_tokens: float) -> float:
        flops = (2 * facts.matmul_params * tokens + 2 * facts.lm_head_params * seqs
                 + 4 * facts.num_layers * hd * ctx_tokens)
        return flops / tp / fl

    stime = out["step_time"]
    stime["bandwidth"] = _v(bw, bw_src, "B/s")
    stime["flops"] = _v(fl, fl_src, "FLOP/s")
    ctx_mean = workload.prompt["mean"] + workload.output["mean"] / 2
    for batch in sorted({1, limit}):
        kv_tok = batch * ctx_mean
        m, c, a = t_mem(kv_tok, batch), t_compute(batch, batch, kv_tok), allreduce(batch, batch)
        moe = (f" ({experts_read(facts.expert_share, batch):.0%} of the experts)" if facts.expert_share < 1 else "")
        stime[f"decode_step_batch_{batch}"] = _v(
            m + c + a, f"weights {streamed(batch) / 1e6:.0f} MB{moe} + KV "
                       f"{kv_tok * kv_dev / 1e6:.1f} MB read: {m * 1e3:.2f} ms; FLOPs: "
                       f"{c * 1e3:.2f} ms; all-reduce + logits gather {a * 1e3:.2f} ms (mean context "
                       f"{ctx_mean:.0f} tokens)", "s")
        stime[f"decode_step_batch_{batch}_roofline_max"] = _v(max(m, c) + a, "max(memory, compute) + all-reduce", "s")
    # ---- load model (an MoE step's experts read at the concurrency limit's batch: conservative)
    A = t_mem(0, limit) + allreduce(0, 0)
    per_token = t_compute(1, 0, 0) + (allreduce(1, 0) - allreduce(0, 0))
    per_sequence = allreduce(0, 1) - allreduce(0, 0)    # the logits gather of a sampled sequence
    Pm, Om = workload.prompt["mean"], workload.output["mean"]
    # decode tokens: GEMMs, lm_head, KV read + attention; prefill tokens + causal attention
    K = (Om * (per_token + per_sequence + t_compute(0, 1, ctx_mean) + ctx_mean * kv_dev / bw)
         + Pm * per_token + t_compute(0, 0, workload.prompt_sq_mean / 2))     # prefill tokens + causal attention
    lam_sat = 1.0 / K
    chunk_budget = limits.max_num_tokens

    def step(lam):
        return math.inf if lam >= lam_sat else A / (1 - lam * K)

    def ttft(lam, prompt):
        s = step(lam)
        chunks = max(1, math.ceil(prompt / max(chunk_budget - lam * Om * s, block)))
        return s / 2 + chunks * s + prompt * per_token

    def concurrency(lam):
        s = step(lam)
        return lam * (ttft(lam, Pm) + max(Om - 1, 0) * s)

    def bisect(ok, hi) -> float:
        lo = 0.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo

    # queueing starts at the first of: the running sequences reach the limit (seats or KV), or the prompt
    # and decode tokens arriving per step fill the step's token budget (max_num_tokens)
    lam_seats = bisect(lambda x: concurrency(x) < onset_limit, lam_sat)
    budget = limits.max_num_tokens
    lam_budget = budget / ((Pm + Om) * A + budget * K)     # solves rate x (P + O) x t_step(rate) = budget
    lam_q = min(lam_seats, lam_budget)
    load = out["load"]
    load["fixed_step_cost"] = _v(A, "streamed weights / bandwidth (+ all-reduce latency)"
                                 + (f"; the experts {limit} sequences read" if facts.expert_share < 1 else ""), "s")
    load["engine_time_per_request"] = _v(K, f"mean prompt {Pm:.0f} + output {Om:.0f} tokens: GEMMs, lm_head, KV reads, "
                                            "attention (see module docstring)", "s")
    load["saturation_rate"] = _v(lam_sat, "1 / engine time per request: beyond it steps grow without bound", "req/s")
    load["seat_limit_rate"] = _v(lam_seats, f"rate where Little's law concurrency reaches {onset_limit:.1f} "
                                            "(queueing_concurrency)", "req/s")
    load["token_budget_rate"] = _v(lam_budget, f"rate where the tokens arriving per step, rate x (prompt + output) x "
                                               f"t_step, reach max_num_tokens {budget}", "req/s")
    first = "running sequences reach the limit" if lam_seats <= lam_budget else "prompts fill the step's token budget"
    load["queueing_onset_rate"] = _v(lam_q, "the lower of the two: " + first, "req/s")
    load["queueing_onset_concurrency"] = _v(min(concurrency(lam_q), onset_limit), "Little's law at the onset rate: "
                                            "rate x (TTFT + (output - 1) x TPOT), at most queueing_concurrency",
                                            "sequences")
    load["tpot_at_onset"] = _v(step(lam_q), "t_step = A / (1 - rate x K)", "s")
    load["ttft_p95_at_onset"] = _v(ttft(lam_q, workload.prompt["p95"]), "TTFT of the p95 prompt at that rate", "s")
    if slo_ttft_p95 is not None or slo_tpot_p95 is not None:
        def meets(lam):
            return ((slo_ttft_p95 is None or ttft(lam, workload.prompt["p95"]) <= slo_ttft_p95)
                    and (slo_tpot_p95 is None or step(lam) <= slo_tpot_p95))

        lam_slo = bisect(meets, lam_q) if meets(1e-9) else 0.0
        load["slo_rate_per_instance"] = _v(lam_slo, f"highest rate <= queueing onset with TTFT(p95 prompt) <= "
                                                    f"{slo_ttft_p95} s and TPOT <= {slo_tpot_p95} s", "req/s")
        if rate is not None:
            load["instances"] = _v(math.ceil(rate / lam_slo) if lam_slo > 0 else None,
                                   f"ceil(rate {rate:g} / SLO rate per instance)" if lam_slo > 0 else
                                   "the SLO cannot be met on this device at any rate", "instances")
    elif rate is not None:
        load["instances"] = _v(math.ceil(rate / lam_q), f"ceil(rate {rate:g} / queueing onset rate) (no SLO given)",
                               "instances")
    # the decodes a step carries where the server should run: at the SLO rate, else at half the queueing onset
    lam_op = lam_slo if slo_ttft_p95 is not None or slo_tpot_p95 is not None else 0.0
    lam_op = lam_op if lam_op > 0 else lam_q / 2
    decodes = min(lam_op * max(Om - 1, 0) * step(lam_op), rec_batch)
    _recommend_budget(st, A, per_token, b, workload, decodes, f"{lam_op:.3g} req/s", slo_ttft_p95, slo_tpot_p95)
    if speculation is not None:
        from kiln.bench.spec_plan import plan_speculation

        def one_sequence(n: int) -> float:   # a step of one sequence computing n tokens, n logits rows
            return t_mem(ctx_mean, n) + t_compute(n, n, n * ctx_mean) + allreduce(n, n)

        draft_step = None
        if draft is not None:
            d_hd = draft.num_heads * draft.head_dim
            draft_step = ((draft.streamed_weight_bytes + ctx_mean * draft.kv_bytes_per_token) / bw
                          + (2 * draft.matmul_params + 2 * draft.lm_head_params
                             + 4 * draft.num_layers * d_hd * ctx_mean) / fl)
        out["speculative"] = plan_speculation(speculation.num_speculative_tokens, speculation.method,
                                              speculation.acceptance, one_sequence, draft_step)
    if pd_transport is not None:
        from kiln.bench.pd_plan import StepModel, plan_pd

        model = StepModel(fixed_s=A, token_s=per_token, sequence_s=per_sequence + t_compute(0, 1, 0),
                          context_s=kv_dev / bw + t_compute(0, 0, 1), attention_s=t_compute(0, 0, 1),
                          chunk=chunk_budget, block=block, seats=onset_limit)

        def colocated(lam: float) -> tuple[float, float]:   # past the queueing onset the mean model says nothing
            return (math.inf, math.inf) if lam > lam_q else (ttft(lam, workload.prompt["p95"]), step(lam))

        if rate is None:
            raise PlanError("the PD plan needs --rate (requests/s in total)")
        out["pd"] = plan_pd(model, workload, pd_transport, rate, colocated, slo_ttft_p95, slo_tpot_p95,
                            pd_max_workers)
    return out


def _recommend_budget(st: dict, a: float, per_token: float, bounds, workload: WorkloadStats, decodes: float,
                      where: str, slo_ttft_p95: float | None, slo_tpot_p95: float | None) -> None:
    """settings: max_num_tokens and the prefill chunk it leaves, from the step time (bench/serving_knobs.py)."""
    d = max(1, round(decodes))
    tb = recommend_token_budget(a, per_token, block=bounds.tokens_per_block, engine_max=bounds.max_num_tokens,
                                decodes=d, prompt_p95=workload.prompt["p95"], slo_ttft_s=slo_ttft_p95,
                                slo_tpot_s=slo_tpot_p95, max_batch_size=st.get("max_batch_size", {}).get("value"))
    st["max_num_tokens"] = _v(tb.max_num_tokens, f"step time {a * 1e3:.1f} ms + {per_token * 1e3:.3f} ms/token: "
                                                 f"{tb.reason}; block-aligned, at most the engine's "
                                                 f"{bounds.max_num_tokens}", "tokens")
    if tb.decoding_max_num_tokens is not None:
        why = (f"the TPOT target {slo_tpot_p95 * 1e3:.0f} ms: a step that carries decodes is at most this long; "
               "steps with none take max_num_tokens")
        st["decoding_max_num_tokens"] = _v(tb.decoding_max_num_tokens, why, "tokens")
    st["prefill_chunk"] = _v(tb.prefill_chunk, f"{'decoding_' if tb.decoding_max_num_tokens else ''}max_num_tokens "
                                               f"less the {d} decodes running at {where} (Little's law: rate x "
                                               "(output - 1) x t_step; decodes go first in a step)", "tokens")
    if tb.tpot_target_s is not None:
        st["tpot_target_s"] = _v(tb.tpot_target_s, "half the TPOT target: the pace each decoding stream is held to (a "
                                 "step beside decodes takes the prefill their lead on it pays for)", "s")
    if tb.short_prompt_lead_s is not None:
        st["short_prompt_lead_s"] = _v(tb.short_prompt_lead_s, "half the TTFT target: a longest prompt lets shorter "
                                       "ones that arrive within it go first (shortest-first within that window)", "s")


def format_plan(p: dict) -> str:
    rows = []
    for section, items in p.items():
        if section == "pd":   # a table of its own: pd_plan.format_pd
            continue
        for name, v in items.items():
            val = v["value"]
            if isinstance(val, float):
                val = _fmt(val, v["unit"])
            elif isinstance(val, int) and v["unit"] == "B":
                val = (f"{val / 2**30:.3f} GiB" if val >= 2**30 else f"{val / 2**20:.1f} MiB" if val >= 2**20
                       else f"{val} B")
            elif isinstance(val, dict):
                val = "; ".join(f"{k} " + ", ".join(f"{q} {x:.0f}" for q, x in d.items()) for k, d in val.items())
            unit = v["unit"] if v["unit"] not in ("B", "s", "B/s", "FLOP/s") else ""
            rows.append((section, name, f"{val} {unit}".strip(),
                         v["source"]))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = min(max(len(r[2]) for r in rows), 40)
    return "\n".join(f"{a:<{w0}}  {b:<{w1}}  {c:>{w2}}  {d}" for a, b, c, d in rows)


def _fmt(x: float, unit: str) -> str:
    if unit == "s":
        return f"{x * 1e3:.2f} ms"
    if unit == "B/s":
        return f"{x / 1e9:.1f} GB/s"
    if unit == "FLOP/s":
        return f"{x / 1e9:.1f} GFLOP/s"
    if unit == "B":
        return f"{x / 2**30:.3f} GiB"
    return f"{x:.3g}"
