"""kiln's error family: every error kiln raises on purpose is a :class:`KilnError`.

Each keeps the built-in base it had before the family existed (``ValueError`` for bad input,
``RuntimeError`` for a state that cannot go on), so ``except ValueError`` code keeps working,
and ``except KilnError`` catches everything kiln reports. Messages name the problem and what to do.
"""

from __future__ import annotations


class KilnError(Exception):
    """Base of every error kiln raises on purpose."""


class CheckpointError(KilnError, ValueError):
    """A checkpoint directory cannot be loaded as it is (unsupported architecture, missing,
    unexpected or mis-shaped tensor, corrupt file)."""


class ConfigError(KilnError, ValueError):
    """An option value is invalid (ExecutorConfig, SamplingParams); the message names it and its range."""


class BuildConfigError(ConfigError):
    """A BuildConfig that cannot be built as it is; the message lists every problem and its fix."""


class EngineBuildError(KilnError, ValueError):
    """build-engine cannot write where it was asked (the output would replace the checkpoint or a
    directory that is not an engine)."""


class EngineLoadError(KilnError, RuntimeError):
    """An engine directory cannot be loaded here (missing or corrupt file, config.json that does not
    follow the engine format, incompatible format or torch version); the message says what to do."""


class EngineInputError(KilnError, ValueError):
    """Inputs of one engine step break the I/O contract or the engine's bounds (names the input)."""


class InvalidRequestError(KilnError, ValueError):
    """A request that can never be served as given (empty prompt, token ids outside the vocabulary,
    prompt or prompt + max_tokens beyond the engine's bounds or the whole KV pool, a duplicate id).
    Raised at submission in the caller's thread; nothing is queued and running requests go on."""


class AdapterLoadError(KilnError, ValueError):
    """A LoRA adapter cannot be served by this engine as it is (a missing or unreadable file, a rank above the
    engine's max_lora_rank, a module the engine does not adapt, mis-shaped or non-finite tensors, a PEFT
    feature kiln does not implement); the message names the file, the tensor and what to do."""


class ExecutorClosedError(KilnError, RuntimeError):
    """The executor was shut down, or its step loop failed (the message says why); no request can run."""


class RequestFailedError(KilnError, RuntimeError):
    """Requests ended by a failure that was not their fault (the engine raised during their step); the
    executor goes on serving. ``outputs`` holds the final outputs of the call, failed ones with ``error`` set."""

    def __init__(self, message: str, outputs: list | None = None):
        super().__init__(message)
        self.outputs = outputs or []


class EngineDeadError(KilnError, RuntimeError):
    """The engine can run no more steps (a tensor-parallel rank's process died, or the engine was closed); the
    message names the rank. Recreate the LLM (or reload the engine) to serve again."""
