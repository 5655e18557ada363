"""Disaggregated prefill and decode: prefill and decode workers (processes, each its own LLM), KV blocks moved
between them over torch.distributed. ``DisaggLLM`` is the frontend; see ``kiln.runtime.disagg.cluster``."""

from kiln.runtime.disagg.cluster import DisaggLLM

__all__ = ["DisaggLLM"]
