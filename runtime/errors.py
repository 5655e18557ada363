"""Errors the runtime raises to callers.

``InvalidRequestError`` (a ``ValueError``) is raised at submission, in the caller's thread, for a
request that can never be served: empty prompt, token ids outside the vocabulary, a prompt longer
than the engine's ``max_input_len``, prompt + ``max_tokens`` beyond ``max_seq_len``, a request whose
blocks exceed the whole KV pool, or a duplicate request id. Nothing is queued, and requests already
running are not disturbed.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as given; the message says which bound it breaks and how to fix it."""


class ExecutorClosedError(RuntimeError):
    """The executor was shut down (or its step loop died); no request can be submitted."""
