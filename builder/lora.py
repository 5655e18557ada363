"""LoRA in the graph: the targeted linears add each token's adapter delta through ``kiln::lora``.

:func:`plan` resolves ``lora_target_modules`` against the family's adaptable modules into the adapter pool's
layout (``kiln.contract.LoraLayout``, written to config.json) and each targeted kiln linear's segment of it.
:class:`LoraModel` is the model with the two adapter inputs of the contract (``lora_slots``, ``lora_weights``):
a forward hook on every targeted linear passes its output through ``kiln::lora`` with the offsets of its
module in the pool. The hooks read the step's adapter inputs from the wrapper, which holds them for the
duration of one forward (the model definitions know nothing of adapters). The merge passes then fuse the
adapters of merged GEMMs into one op (``passes.common.merge_sibling_linears``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

import kiln.plugins.lora  # noqa: F401  (registers kiln::lora)
from kiln.contract import LoraLayout, ModelConfig


@dataclass(frozen=True)
class LoraPlan:
    layout: LoraLayout
    # kiln linear path -> its kiln::lora segment (a_offset, b_offset, b_stride, y_col, n)
    segments: dict[str, list[int]]


def plan(build, model: ModelConfig) -> LoraPlan | None:
    """The adapter pool layout and the segments of every targeted linear (None without lora_target_modules);
    BuildConfigError for a target name the family does not have."""
    if not build.lora_target_modules:
        return None
    from kiln.model_defs import select_targets

    targets = select_targets(model, build.lora_target_modules)
    layout = LoraLayout(max_rank=build.max_lora_rank, num_layers=model.num_layers, modules=[t.module for t in targets])
    segments: dict[str, list[int]] = {}
    for layer in range(model.num_layers):
        for t in targets:
            a_off, b_off = layout.offsets(layer, t.module.name)
            for path, first, end in t.linears:
                segments[path.format(layer=layer)] = [a_off, b_off + first, t.module.out_features, 0, end - first]
    return LoraPlan(layout, segments)


class _StepAdapters:
    """The adapter inputs of the forward in progress (set by LoraModel.forward, read by the hooks)."""

    slots: torch.Tensor | None = None
    weights: torch.Tensor | None = None


def _add_lora(step: _StepAdapters, segments: list[int], rank: int, module, inputs, output):
    return torch.ops.kiln.lora(output, inputs[0], step.slots, step.weights, segments, rank)


class LoraModel(nn.Module):
    """``model`` (the family's packed-token module) taking the contract's adapter inputs too."""

    def __init__(self, model: nn.Module, lora: LoraPlan):
        super().__init__()
        self.model = model
        self._step = _StepAdapters()
        rank = lora.layout.max_rank
        for path, segments in lora.segments.items():
            model.get_submodule(path).register_forward_hook(functools.partial(_add_lora, self._step, segments, rank))

    def forward(self, input_ids, position_ids, seq_lens, context_lens, block_tables, slot_mapping, logits_indices,
                kv_cache, lora_slots, lora_weights):
        self._step.slots, self._step.weights = lora_slots, lora_weights
        try:
            return self.model(input_ids, position_ids, seq_lens, context_lens, block_tables, slot_mapping,
                              logits_indices, kv_cache)
        finally:
            self._step.slots = self._step.weights = None
