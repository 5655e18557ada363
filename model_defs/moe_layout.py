"""Checkpoint layouts of MoE layers: per-expert tensors (the files on the Hub, and what transformers 5 saves)
written into kiln's stacked expert parameters (:class:`~kiln.model_defs.layers.Experts`)."""

from __future__ import annotations

from kiln.contract import ModelConfig
from kiln.model_defs.weights import Part, WeightSpec


def expert_specs(cfg: ModelConfig, layer: int, hf_prefix: str, names: tuple[str, str, str]) -> dict[str, WeightSpec]:
    """The layout entries of layer ``layer``'s experts: ``{hf_prefix}.{e}.{gate|up|down}.weight`` for each expert e,
    ``names`` the checkpoint's (gate, up, down) names (Mixtral: w1, w3, w2; Qwen3-MoE: gate_proj, up_proj,
    down_proj)."""
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gate_up, down = f"layers.{layer}.mlp.experts.gate_up_proj", f"layers.{layer}.mlp.experts.down_proj"
    whole = {gate_up: (e, 2 * inter, h), down: (e, h, inter)}

    def part(name: str, index: int, start: int):
        return lambda t: {Part(name, index, start, whole[name]): t}

    gate, up, dn = names
    out = {}
    for i in range(e):
        out[f"{hf_prefix}.{i}.{gate}.weight"] = WeightSpec((inter, h), part(gate_up, i, 0))
        out[f"{hf_prefix}.{i}.{up}.weight"] = WeightSpec((inter, h), part(gate_up, i, inter))
        out[f"{hf_prefix}.{i}.{dn}.weight"] = WeightSpec((h, inter), part(down, i, 0))
    return out
