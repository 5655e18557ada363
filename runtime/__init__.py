"""kiln.runtime."""

from kiln.runtime.engine import Engine, EngineLoadError
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.llm import LLM
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams

__all__ = ["Engine", "EngineLoadError", "InvalidRequestError", "LLM", "RequestOutput", "SamplingParams"]
