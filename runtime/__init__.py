"""kiln.runtime: load an engine directory and serve requests with in-flight batching (``LLM``).

Errors are kiln's family (``kiln.contract``), re-exported here where callers catch them.
"""

from kiln.contract import (
    ConfigError,
    EngineInputError,
    EngineLoadError,
    ExecutorClosedError,
    InvalidRequestError,
    KilnError,
    RequestFailedError,
)
from kiln.runtime.engine import Engine
from kiln.runtime.executor import Executor, ExecutorConfig
from kiln.runtime.llm import LLM
from kiln.runtime.outputs import RequestMetrics, RequestOutput
from kiln.runtime.sampling_params import SamplingParams

__all__ = [
    "ConfigError", "Engine", "EngineInputError", "EngineLoadError", "Executor", "ExecutorClosedError",
    "ExecutorConfig", "InvalidRequestError", "KilnError", "LLM", "RequestFailedError", "RequestMetrics",
    "RequestOutput", "SamplingParams",
]
