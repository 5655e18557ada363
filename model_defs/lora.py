"""Which modules of a family take LoRA adapters, under PEFT's names, and which kiln linears compute them.

A family lists its adaptable modules with ``lora_targets(cfg)``: each is a module of the Hugging Face model
(named as PEFT's ``target_modules`` matches it, with its path and shape: :class:`kiln.contract.LoraModule`)
and the kiln linear(s) that compute its output. Usually one linear computes the whole module; a fused
Hugging Face module that kiln splits at load (GPT-2's ``c_attn`` into q/k/v) maps onto several linears, each
computing a column range of the module's output (so they share the adapter's A and split its B).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.contract import BuildConfigError, LoraModule, ModelConfig


@dataclass(frozen=True)
class LoraTarget:
    module: LoraModule
    # (kiln linear path with "{layer}", first and last + 1 output column of the module it computes)
    linears: tuple[tuple[str, int, int], ...]


def whole(module: LoraModule, linear: str) -> LoraTarget:
    """A module computed by one kiln linear."""
    return LoraTarget(module, ((linear, 0, module.out_features),))


def lora_targets(config: ModelConfig) -> list[LoraTarget]:
    """The family's adaptable modules (BuildConfigError for a family without a LoRA mapping)."""
    from kiln.model_defs.checkpoint import family_of

    family = family_of(config.architecture)
    targets = getattr(family, "lora_targets", None)
    if targets is None:
        raise BuildConfigError(f"{config.architecture} has no LoRA module mapping in kiln yet; build without "
                               "lora_target_modules")
    return targets(config)


def select_targets(config: ModelConfig, names: list[str]) -> list[LoraTarget]:
    """The targets ``names`` pick, in the family's order. A name matches a module as PEFT's target_modules
    does (the module's name, or its last dotted parts: ``q_proj`` matches ``self_attn.q_proj``);
    ``all-linear`` picks every one. BuildConfigError naming a name that matches nothing."""
    targets = lora_targets(config)
    if "all-linear" in names:
        return targets

    def matches(target: LoraTarget, name: str) -> bool:
        return target.module.name == name or target.module.name.endswith("." + name)

    unknown = [n for n in names if not any(matches(t, n) for t in targets)]
    if unknown:
        raise BuildConfigError(f"lora_target_modules {unknown} match no module of {config.architecture}; its "
                               f"modules are {[t.module.name for t in targets]} (or 'all-linear')")
    return [t for t in targets if any(matches(t, n) for n in names)]
