"""Layers shared by every family, written in the packed-token form of the engine contract.

Activations are [num_tokens, hidden] with no padding; attention goes through the
``kiln::paged_attention`` plugin, which writes this step's K/V into the pool in place.
The layers are written plainly (``residual + x`` then a norm; separate q/k/v and
gate/up projections): fusing them is the builder's job, not the model's.

Tensor parallelism (``tp``, a :class:`~kiln.contract.TensorParallelMapping`, None for one rank): the
module of one rank holds its shard's shapes: q/k/v and gate/up (fc_in) column-parallel (fewer heads, a
slice of the MLP), o_proj and down_proj (fc_out) row-parallel (``RowParallelLinear``: partial sums
all-reduced, bias added once), the LM head vocab-parallel (``VocabParallelHead``: logits all-gathered),
the embedding whole; an MoE layer's experts split along their intermediate dim (``MoE``: output
all-reduced). ``kiln.model_defs.tensor_parallel.shard_weights`` cuts the weights to match.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import kiln.plugins  # noqa: F401  (registers torch.ops.kiln.*)
from kiln.contract import ModelConfig, TensorParallelMapping
from kiln.plugins.rotary import cos_sin_table, rope_attention_factor, rope_inv_freq

ops = torch.ops.kiln


class StepInputs(NamedTuple):
    """The contract tensors every layer may read (see DESIGN.md)."""

    position_ids: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    kv_cache: torch.Tensor


def rope_table(cfg: ModelConfig, theta: float | None = None, scaling: dict | None = None) -> torch.Tensor:
    """The cos/sin table of ``cfg``'s rotary dims for every position (``theta``/``scaling``: another base than
    the model's, e.g. Gemma 3's sliding layers)."""
    theta, scaling = (cfg.rope_theta, cfg.rope_scaling) if theta is None else (theta, scaling)
    inv_freq = rope_inv_freq(cfg.rotary_dim or cfg.head_dim, theta, scaling)
    return cos_sin_table(cfg.max_position_embeddings, inv_freq,
                         rope_attention_factor(scaling, cfg.max_position_embeddings))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """torch LayerNorm; named here so families pick a norm by config."""


class RowParallelLinear(nn.Linear):
    """A linear whose input features are split over ``tp_size`` ranks: each rank multiplies its slice, the
    partial sums are all-reduced, then the bias (whole on every rank) is added once. One rank: nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_size: int = 1):
        super().__init__(in_features // tp_size, out_features, bias=bias)
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        y = ops.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelHead(nn.Linear):
    """The LM head split by vocabulary rows over ``tp_size`` ranks (``rows_per_rank`` each, the last padded
    with zero rows): each rank's logits are all-gathered along the vocabulary and the padding cut off."""

    def __init__(self, hidden_size: int, vocab_size: int, rows_per_rank: int, tp_size: int):
        super().__init__(hidden_size, rows_per_rank, bias=False)
        self.vocab_size, self.tp_size = vocab_size, tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = ops.all_gather(F.linear(x, self.weight), self.tp_size)
        return logits if logits.shape[-1] == self.vocab_size else logits[:, :self.vocab_size]


def tp_size_of(tp: TensorParallelMapping | None) -> int:
    return 1 if tp is None else tp.tp_size


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA, optional rotary embedding, the layer's sliding window (``cfg.window_of``),
    softmax scale and attention-logit soft-capping, and optional per-head q/k norms (``qk_norm`` builds each: a
    norm over head_dim, applied before the rotary embedding: Qwen3, Gemma 3)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, use_rope: bool, tp: TensorParallelMapping | None = None,
                 qk_norm: Callable[[int], nn.Module] | None = None):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        rank = tp.rank_model(cfg) if tp is not None else cfg   # this rank's heads
        self.num_heads, self.num_kv_heads, self.head_dim = rank.num_heads, rank.num_kv_heads, d
        self.q_proj = nn.Linear(h, rank.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, rank.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, rank.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, cfg.attention_out_bias, tp_size_of(tp))
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(d), qk_norm(d)
        else:
            self.q_norm = self.k_norm = None
        self.layer_idx = layer_idx
        self.use_rope = use_rope
        self.rotary_dim = cfg.rotary_dim or d
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else d**-0.5
        self.sliding_window = cfg.window_of(layer_idx)
        self.softcap = cfg.attn_logit_softcapping
        # the sliding layers of a model with a local rotary base read the LM's local table (Gemma 3)
        self.local_rope = cfg.local_rope_theta > 0 and bool(cfg.layer_types) and \
            cfg.layer_types[layer_idx] == "sliding_attention"

    def forward(self, x: torch.Tensor, step: StepInputs, rope_table: torch.Tensor | None) -> torch.Tensor:
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope and self.rotary_dim < self.head_dim:   # partial: the first rotary_dim dims of each head
            r = self.rotary_dim
            qr, kr = ops.rotary_embedding(q[..., :r].contiguous(), k[..., :r].contiguous(), step.position_ids,
                                          rope_table)
            q, k = torch.cat([qr, q[..., r:]], -1), torch.cat([kr, k[..., r:]], -1)
        elif self.use_rope:
            q, k = ops.rotary_embedding(q, k, step.position_ids, rope_table)
        out = ops.paged_attention(
            q, k, v, step.kv_cache, self.layer_idx, step.seq_lens, step.context_lens,
            step.block_tables, step.slot_mapping, self.scale, self.sliding_window, self.softcap,
        )
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim))


GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")   # cfg.hidden_act of a gated MLP: SwiGLU, GeGLU (tanh GELU)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu: Llama, Mistral, Qwen, Phi-3) or GeGLU (gelu_pytorch_tanh: Gemma)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallelMapping | None = None):
        super().__init__()
        if cfg.hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"gated MLP activation {cfg.hidden_act!r} is not one of {GATED_ACTIVATIONS}")
        n = tp_size_of(tp)
        inter = cfg.intermediate_size // n
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, n)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(ops.gelu(gate, "tanh") * up if self.gelu else ops.silu_mul(gate, up))


class Router(nn.Module):
    """The router of an MoE layer: ``weight`` [experts, hidden], read by ``kiln::moe`` (so the builder's GEMM passes
    leave it in the engine dtype: its choice decides which expert weights a step reads)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class Experts(nn.Module):
    """The experts of an MoE layer, stacked: ``gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up
    rows) and ``down_proj`` [E, H, I] (transformers 5's in-memory layout)."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))


class MoE(nn.Module):
    """Sparse MoE MLP (Mixtral, Qwen3-MoE): each token's ``num_experts_per_tok`` experts of ``num_experts``, through
    ``kiln::moe``. Tensor parallelism splits every expert's intermediate dim (gate/up rows, down columns) like the
    dense MLP's; the partial sums are all-reduced."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallelMapping | None = None):
        super().__init__()
        self.tp_size = tp_size_of(tp)
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size // self.tp_size)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.moe(x, self.gate.weight, self.experts.gate_up_proj, None, self.experts.down_proj, None, self.top_k,
                    self.renormalize, 0, 0)
        return ops.all_reduce(y) if self.tp_size > 1 else y


def mlp_of(cfg: ModelConfig, layer: int, tp: TensorParallelMapping | None = None) -> nn.Module:
    """Layer ``layer``'s MLP: the MoE block for the layers in ``cfg.moe_layers``, else the gated MLP."""
    return MoE(cfg, tp) if cfg.num_experts and layer in cfg.moe_layers else GatedMLP(cfg, tp)


class GeluMLP(nn.Module):
    """fc_out(gelu(fc_in(x))): GPT-2."""

    def __init__(self, cfg: ModelConfig, approximate: str, tp: TensorParallelMapping | None = None):
        super().__init__()
        n = tp_size_of(tp)
        self.fc_in = nn.Linear(cfg.hidden_size, cfg.intermediate_size // n, bias=True)
        self.fc_out = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, n)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(ops.gelu(self.fc_in(x), self.approximate))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, input_layernorm: nn.Module, self_attn: Attention, post_attention_layernorm: nn.Module,
                 mlp: nn.Module):
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    def forward(self, x: torch.Tensor, step: StepInputs, rope_table: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step, rope_table)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderOnlyLM(nn.Module):
    """Embeddings -> decoder layers -> final norm -> lm_head, over packed tokens.

    forward() takes the engine contract's inputs and returns float32 logits for the rows
    named by ``logits_indices``. ``embed_scale``: the embeddings are multiplied by it rounded to their dtype
    (Gemma: sqrt(hidden)); ``local_rope_table``: the table of the layers whose attention has ``local_rope``;
    ``cfg.final_logit_softcapping`` caps the logits (in fp32).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layers: list[nn.Module],
        norm: nn.Module,
        rope_table: torch.Tensor | None,
        learned_positions: bool = False,
        tp: TensorParallelMapping | None = None,
        local_rope_table: torch.Tensor | None = None,
        embed_scale: float | None = None,
    ):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size) if learned_positions else None
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        if tp_size_of(tp) > 1:   # its own (sliced) weight even when tied: the embedding stays whole
            self.lm_head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, tp.vocab_size_per_rank, tp.tp_size)
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
        for name, table in (("rope_table", rope_table), ("local_rope_table", local_rope_table)):
            if table is not None:
                self.register_buffer(name, table, persistent=False)
            else:
                setattr(self, name, None)
        # the scale as each dtype holds it (transformers rounds it to the embedding's dtype)
        self.embed_scale = None if embed_scale is None else {
            dt: float(torch.tensor(embed_scale, dtype=dt, device="cpu"))
            for dt in (torch.float32, torch.bfloat16, torch.float16)}
        self.final_softcap = cfg.final_logit_softcapping

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        seq_lens: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        logits_indices: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        step = StepInputs(position_ids, seq_lens, context_lens, block_tables, slot_mapping, kv_cache)
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale[x.dtype]
        if self.embed_positions is not None:
            x = x + self.embed_positions(position_ids)
        for layer in self.layers:
            local = self.local_rope_table is not None and layer.self_attn.local_rope
            x = layer(x, step, self.local_rope_table if local else self.rope_table)
        x = self.norm(x[logits_indices])
        logits = self.lm_head(x).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
