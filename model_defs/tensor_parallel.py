"""Cut a model's weights into the shard of one tensor-parallel rank (the layout of ``kiln.contract``'s
:class:`~kiln.contract.TensorParallelMapping`, the shapes of ``layers.py``'s modules built with ``tp``).

Works on kiln parameter names, which every family shares (``layers.N.self_attn.q_proj.weight``, ...,
``layers.N.mlp.experts.gate_up_proj`` for an MoE layer's stacked experts), so a
new family needs nothing here unless it adds a new kind of projection; ``build_model`` loads the shard
with ``strict=True``, so a weight this function does not know fails the build by name instead of being
silently replicated.
"""

from __future__ import annotations

import torch

from kiln.contract import ModelConfig, TensorParallelMapping

COLUMN_PARALLEL = {"gate_proj", "up_proj", "fc_in"}      # output rows split (with their bias)
ROW_PARALLEL = {"o_proj", "down_proj", "fc_out"}         # input columns split (bias whole)


def _rows(w: torch.Tensor, part: slice) -> torch.Tensor:
    return w[part].clone()    # its own storage: a view would carry the whole weight into the rank file


def vocab_rows(w: torch.Tensor, tp: TensorParallelMapping, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of an LM head ``[vocab, hidden]``, zero rows padding the last shard."""
    n = tp.vocab_size_per_rank
    shard = w[rank * n:(rank + 1) * n]
    if shard.shape[0] < n:
        shard = torch.cat([shard, shard.new_zeros(n - shard.shape[0], *shard.shape[1:])])
    return shard.clone()


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], tp: TensorParallelMapping,
                  rank: int) -> dict[str, torch.Tensor]:
    """The weights rank ``rank`` of ``tp`` holds, under the same names (a tied LM head gets its own slice)."""
    if tp.tp_size == 1:
        return dict(weights)
    d = cfg.head_dim
    heads = slice(rank * tp.num_heads_per_rank * d, (rank + 1) * tp.num_heads_per_rank * d)
    kv = tp.kv_heads(rank)
    kv_heads = slice(kv.start * d, kv.stop * d)
    mlp = slice(rank * tp.intermediate_size_per_rank, (rank + 1) * tp.intermediate_size_per_rank)
    per = cfg.moe_intermediate_size // tp.tp_size
    expert = slice(rank * per, (rank + 1) * per)
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        module, _, kind = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if leaf == "experts" and kind == "gate_up_proj":   # [E, 2I, H]: this rank's gate rows and up rows
            gate, up = w.split(cfg.moe_intermediate_size, dim=1)
            out[name] = torch.cat([gate[:, expert], up[:, expert]], dim=1)
        elif leaf == "experts" and kind == "down_proj":    # [E, H, I]: this rank's columns
            out[name] = w[:, :, expert].contiguous()
        elif leaf == "q_proj":
            out[name] = _rows(w, heads)
        elif leaf in ("k_proj", "v_proj"):
            out[name] = _rows(w, kv_heads)
        elif leaf in COLUMN_PARALLEL:
            out[name] = _rows(w, mlp)
        elif leaf in ROW_PARALLEL and kind == "weight":
            out[name] = w[:, heads if leaf == "o_proj" else mlp].clone()
        elif name == "lm_head.weight":
            out[name] = vocab_rows(w, tp, rank)
        else:   # norms, embeddings, row-parallel biases: whole on every rank
            out[name] = w
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = vocab_rows(weights["embed_tokens.weight"], tp, rank)
    return out
