"""The engine facts bench and plan need (sizes, bounds, shapes), read in ONE place.

``engine_facts(dir)`` reads a built engine's typed config (``kiln.contract.read_engine_config``);
``hf_facts(config.json, ...)`` estimates the same facts for a Hugging Face model that has not been built
yet. Everything else in kiln.bench takes an :class:`EngineFacts`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln.contract import (
    KV_CACHE_DTYPES,
    QUANTIZED_KV_DTYPES,
    EngineBounds,
    EngineLoadError,
    KilnError,
    kv_row_size,
    read_engine_config,
)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_QUANT_BYTES = {"none": None, "int8_weight_only": 1.0, "int4_weight_only": 0.5}


class FactsError(KilnError, ValueError):
    """The engine directory or model config cannot be read; the message says which file and why."""


@dataclass
class EngineFacts:
    """Sizes and bounds of one engine (or of a model sized as if it were built).

    weights_bytes: all weights as stored. streamed_weight_bytes: what a step of one sequence reads (weights minus the
    embedding table, of which a step gathers only a few rows; of an MoE model's experts, the share one token
    uses). matmul_params: weights multiplied per token (2 FLOPs each; an MoE token's experts only);
    lm_head_params: multiplied once per sampled sequence. embedding_bytes: the embedding table (whole on every
    tensor-parallel rank). origin: where each number came from.

    tp_size > 1: the facts of a tensor-parallel engine, whose weights, streamed weights, KV bytes per token and
    activation peak are ONE rank's (what a device holds); the model's shape and GEMM counts stay whole.
    """

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype: str
    quantization: str
    weights_bytes: int
    streamed_weight_bytes: int
    kv_bytes_per_token: int
    activation_peak_bytes: int
    matmul_params: int
    lm_head_params: int
    bounds: EngineBounds
    embedding_bytes: int = 0
    tie_word_embeddings: bool = False
    # mixture of experts: all experts' weight bytes (a device's), the share of them one token reads (top_k /
    # num_experts; streamed_weight_bytes counts that share: a batch of B tokens reads 1 - (1 - share)^B of them)
    expert_bytes: int = 0
    expert_share: float = 1.0
    total_params: int = 0
    active_params: int = 0
    tp_size: int = 1
    kv_cache_dtype: str = ""                                     # the pool's (int8 / fp8: with their scales)
    special_token_ids: list[int] = field(default_factory=list)   # eos / bos: kept out of synthetic prompts
    lora_slot_bytes: int = 0   # one slot of the LoRA adapter pool (an engine built with lora_target_modules)
    origin: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _layer_params(m: dict) -> int:
    """Weights of one dense decoder layer's GEMMs (attention projections + MLP)."""
    h, hd = m["hidden_size"], m["head_dim"]
    attn = h * m["num_heads"] * hd * 2 + h * m["num_kv_heads"] * hd * 2
    gated = m.get("architecture", "") != "GPT2LMHeadModel"
    mlp = (3 if gated else 2) * h * m["intermediate_size"]
    return attn + mlp


def _moe_params(m: dict) -> tuple[int, int, float]:
    """(GEMM weights one token multiplies in all layers, all experts' weights, experts a token uses / all) of a
    model's config (``ModelConfig`` keys); a dense model: (layers x layer GEMMs, 0, 1)."""
    layers, moe = m["num_layers"], len(m.get("moe_layers") or []) if m.get("num_experts") else 0
    if not moe:
        return layers * _layer_params(m), 0, 1.0
    h, e, k = m["hidden_size"], m["num_experts"], m["num_experts_per_tok"]
    attn = _layer_params({**m, "intermediate_size": 0})
    expert = 3 * h * m["moe_intermediate_size"]
    per_token = layers * attn + (layers - moe) * 3 * h * m["intermediate_size"] + moe * (k * expert + e * h)
    return per_token, moe * e * expert, k / e


def _kv_layout(kv_cache_dtype: str) -> str:
    """How one KV row's bytes are made up, for the ``origin`` notes."""
    if kv_cache_dtype in QUANTIZED_KV_DTYPES:
        return f"(head_dim + 2 B scale) x 1 B ({kv_cache_dtype})"
    return f"head_dim x {KV_CACHE_DTYPES[kv_cache_dtype].itemsize} B ({kv_cache_dtype})"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FactsError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FactsError(f"{path}: not valid JSON ({exc})") from None


def engine_facts(engine_dir: str | Path) -> EngineFacts:
    """Facts of a built engine, from its config.json (the builder's memory plan and bounds)."""
    try:
        cfg = read_engine_config(engine_dir)
    except EngineLoadError as exc:
        raise FactsError(str(exc)) from None
    m, mem = cfg.model, cfg.memory
    table = m.vocab_size * m.hidden_size * _DTYPE_BYTES[cfg.dtype]
    # the embedding table is not streamed, unless it is also the LM head (tied, one rank)
    embed = 0 if m.tie_word_embeddings and cfg.tp_size == 1 else table
    tok = cfg.tokenizer
    src = f"engine {Path(engine_dir) / 'config.json'}"
    per_rank = f" (one rank of {cfg.tp_size})" if cfg.tp_size > 1 else ""
    matmul, experts, share = _moe_params(m.to_dict())
    expert_bytes = int(experts * (_QUANT_BYTES[cfg.quantization] or _DTYPE_BYTES[cfg.dtype]) / cfg.tp_size)
    streamed = mem.decode_read_bytes or max(mem.weights_bytes - embed, 0)   # the memory plan's, when recorded
    return EngineFacts(
        name=str(engine_dir), architecture=m.architecture, num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        intermediate_size=m.intermediate_size, vocab_size=m.vocab_size,
        dtype=cfg.dtype, quantization=cfg.quantization, weights_bytes=mem.weights_bytes,
        streamed_weight_bytes=streamed, kv_bytes_per_token=cfg.kv_bytes_per_token,
        activation_peak_bytes=mem.activation_peak_bytes, matmul_params=matmul,
        lm_head_params=m.vocab_size * m.hidden_size, bounds=cfg.bounds, embedding_bytes=table,
        tie_word_embeddings=m.tie_word_embeddings, expert_bytes=expert_bytes, expert_share=share,
        total_params=mem.total_params, active_params=mem.active_params, tp_size=cfg.tp_size,
        kv_cache_dtype=cfg.kv_cache_dtype,
        special_token_ids=sorted(set(tok.eos_token_ids)
                                 | ({tok.bos_token_id} if tok.bos_token_id is not None else set())),
        lora_slot_bytes=cfg.lora.slot_bytes(cfg.torch_dtype) if cfg.lora is not None else 0,
        origin={
            "weights_bytes": f"{src} memory.weights_bytes (builder's memory plan){per_rank}",
            "streamed_weight_bytes": (f"{src} memory.decode_read_bytes (builder's memory plan: weights a decode step "
                                      f"of one sequence reads){per_rank}" if mem.decode_read_bytes else
                                      "weights_bytes minus the embedding table (vocab x hidden x dtype) unless it is "
                                      f"the LM head{per_rank}"),
            "expert_bytes": "experts' parameters from the model shape x the stored width" + per_rank,
            "parameters": f"{src} memory.total_params / active_params (the builder's count of the module)",
            "kv_bytes_per_token": f"{src}: 2 x layers x kv_heads x {_kv_layout(cfg.kv_cache_dtype)} "
                                  f"(kiln.contract){per_rank}",
            "activation_peak_bytes": f"{src} memory.activation_peak_bytes (arena at the max profile){per_rank}",
            "bounds": f"{src} bounds",
            "kv_cache_dtype": f"{src} kv_cache_dtype",
            "matmul_params": "decoder layers' GEMM weights one token multiplies (an MoE token: its top_k experts "
                             "and the router), from the model shape in config.json",
            "lora_slot_bytes": f"{src} lora: layers x max_rank x (in + out features) of each module x dtype",
        },
    )


def hf_facts(config_path: str | Path, dtype: str = "bfloat16", quantization: str = "none", *,
             max_batch_size: int = 64, max_num_tokens: int = 4096, max_seq_len: int | None = None,
             max_input_len: int | None = None, tokens_per_block: int = 16, kv_cache_dtype: str = "auto"
             ) -> EngineFacts:
    """Facts of a Hugging Face model not built yet: sizes from its config.json, dtype, quantization and KV
    cache dtype (auto: the dtype; int8 / fp8: 8-bit rows with their scales, as kiln.contract lays them out).

    Estimates (said so in ``origin``): weights = GEMM weights at the quantized width + embeddings, norms and
    position tables at dtype (the rotary table in fp32); activation peak = the largest step's hidden states
    and MLP intermediates plus the logits.
    """
    path = Path(config_path)
    if path.is_dir():
        path = path / "config.json"
    hf = _read_json(path)
    if dtype not in _DTYPE_BYTES:
        raise FactsError(f"dtype {dtype!r} is not one of {list(_DTYPE_BYTES)}")
    if quantization not in _QUANT_BYTES:
        raise FactsError(f"quantization {quantization!r} is not one of {list(_QUANT_BYTES)}")
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if kv_dtype not in KV_CACHE_DTYPES:
        raise FactsError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {['auto', *KV_CACHE_DTYPES]}")
    try:
        arch = (hf.get("architectures") or ["?"])[0]
        h = hf.get("hidden_size") or hf["n_embd"]
        layers = hf.get("num_hidden_layers") or hf["n_layer"]
        heads = hf.get("num_attention_heads") or hf["n_head"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or h // heads
        inter = hf.get("intermediate_size") or hf.get("n_inner") or 4 * h
        vocab = hf["vocab_size"]
        max_pos = hf.get("max_position_embeddings") or hf.get("n_positions") or 2048
        experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
        moe = {}
        if experts:   # Mixtral: every layer, experts intermediate_size wide; Qwen3-MoE: moe_intermediate_size
            step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or [])
            moe = dict(num_experts=experts, num_experts_per_tok=int(hf["num_experts_per_tok"]),
                       moe_intermediate_size=int(hf.get("moe_intermediate_size") or inter),
                       moe_layers=[i for i in range(layers) if i not in dense and (i + 1) % step == 0])
    except KeyError as exc:
        raise FactsError(f"{path}: key {exc} is missing; is this a Hugging Face decoder config?") from None
    m = dict(architecture=arch, hidden_size=h, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
             intermediate_size=inter, num_layers=layers, **moe)
    elem = _DTYPE_BYTES[dtype]
    gemm_elem = _QUANT_BYTES[quantization] or elem
    tied = bool(hf.get("tie_word_embeddings", False))
    per_token, expert_params, share = _moe_params(m)
    routers = len(moe.get("moe_layers", [])) * experts * h     # kept at dtype (never quantized)
    layer_gemms = per_token - share * expert_params - routers + expert_params   # every layer's, all experts
    embed = vocab * h * elem
    lm_head = 0 if tied else vocab * h * gemm_elem
    # position tables: GPT-2's learned embeddings, or the rotary cos/sin table (fp32) the Llama family keeps
    positions = max_pos * h * elem if arch == "GPT2LMHeadModel" else max_pos * head_dim * 4
    weights = int(layer_gemms * gemm_elem + routers * elem + embed + lm_head + (2 * layers + 1) * h * elem
                  + positions)
    unused = int((1 - share) * expert_params * gemm_elem)      # the experts a token does not read
    params = int(layer_gemms + routers + vocab * h * (1 if tied else 2) + (2 * layers + 1) * h)
    max_seq_len = max_seq_len or max_pos
    facts = EngineFacts(
        name=str(path), architecture=arch, num_layers=layers, hidden_size=h, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, dtype=dtype, quantization=quantization,
        weights_bytes=weights, embedding_bytes=embed, tie_word_embeddings=tied,
        streamed_weight_bytes=weights - (0 if tied else embed) - unused,
        expert_bytes=int(expert_params * gemm_elem), expert_share=share,
        total_params=params, active_params=int(params - (1 - share) * expert_params),
        kv_bytes_per_token=2 * layers * kv_heads * kv_row_size(head_dim, kv_dtype) * KV_CACHE_DTYPES[kv_dtype].itemsize,
        kv_cache_dtype=kv_dtype,
        activation_peak_bytes=int(max_num_tokens * (4 * h + 2 * inter) * elem + max_batch_size * vocab * 4),
        matmul_params=per_token, lm_head_params=vocab * h,
        bounds=EngineBounds(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                            max_input_len=max_input_len or max_seq_len, max_seq_len=max_seq_len,
                            tokens_per_block=tokens_per_block, max_num_logits=max_batch_size,
                            max_blocks_per_seq=-(-max_seq_len // tokens_per_block)),
    )
    facts.origin = {
        "weights_bytes": f"estimated from {path} (GEMMs at {quantization}, embeddings/norms at {dtype})",
        "streamed_weight_bytes": "weights_bytes minus the untied embedding table"
                                 + (" and the experts a token does not use" if experts else ""),
        "expert_bytes": f"experts' parameters from {path} at {quantization}",
        "parameters": f"estimated from {path} (GEMMs, routers, embeddings, norms)",
        "kv_bytes_per_token": f"2 x layers x kv_heads x {_kv_layout(kv_dtype)}, from {path}",
        "activation_peak_bytes": "estimated: max_num_tokens x (4 x hidden + 2 x intermediate) x dtype + logits "
                                 "(build the engine for the builder's exact plan)",
        "bounds": "planner options (no engine built)",
        "kv_cache_dtype": f"--kv-cache-dtype {kv_cache_dtype}"
                          + (f" (the dtype, {dtype})" if kv_cache_dtype == "auto" else ""),
        "matmul_params": f"decoder layers' GEMM weights, from {path}",
    }
    return facts
