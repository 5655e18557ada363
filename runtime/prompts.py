"""What a prompt may be, checked in the caller's thread (every entry point: generate, stream, generate_async,
submit, and the executor's own submit).

A prompt is text (a ``str`` of valid Unicode) or token ids: a sequence (list, tuple, range) of integers --
Python ``int``, numpy integer scalars or 0-d integer torch tensors -- or a 1-D integer numpy array or torch
tensor. All of them become the same list of ``int``. Anything else is refused with InvalidRequestError
naming its type: floats (even 6.0), bools (True is not a token id), ``bytes``, strings of digits, nested
sequences, sets and iterators, arrays of another rank or dtype. Whether the ids are in the vocabulary is
the executor's check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kiln.contract import InvalidRequestError
from kiln.runtime.fields import is_integer

Prompt = str | Sequence[int] | np.ndarray | torch.Tensor

_TEXTLIKE = (str, bytes, bytearray, memoryview)


def _is_token_id(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.ndim == 0 and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool
    return is_integer(x)


def _array_ids(prompt: np.ndarray | torch.Tensor) -> list[int]:
    kind = "numpy array" if isinstance(prompt, np.ndarray) else "torch tensor"
    if prompt.ndim != 1:
        raise InvalidRequestError(f"a prompt of token ids must be 1-D, got a {prompt.ndim}-D {kind}")
    if isinstance(prompt, np.ndarray):
        ok = prompt.dtype.kind in "iu"
    else:
        ok = not (prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool)
    if not ok:
        raise InvalidRequestError(f"prompt token ids must be integers, got a {kind} of {prompt.dtype}")
    return [int(t) for t in prompt.tolist()]


def prompt_token_ids(prompt: Any) -> list[int]:
    """The token ids of a non-text prompt as plain ints, or InvalidRequestError naming what is wrong."""
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        return _array_ids(prompt)
    if isinstance(prompt, _TEXTLIKE) or not isinstance(prompt, Sequence):
        raise InvalidRequestError(f"a prompt must be a str or a sequence of integer token ids, "
                                  f"got {type(prompt).__name__}")
    ids = []
    for i, t in enumerate(prompt):
        if not _is_token_id(t):
            why = " (True/False are not token ids)" if isinstance(t, (bool, np.bool_)) else ""
            raise InvalidRequestError(f"prompt token ids must be integers, got {type(t).__name__} at index {i} "
                                      f"({t!r:.40}){why}")
        ids.append(int(t))
    return ids


def check_text(prompt: str) -> None:
    """InvalidRequestError unless ``prompt`` is valid Unicode (a lone surrogate cannot be tokenized)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"the prompt text is not valid Unicode: {exc.object[exc.start]!r} at index "
                                  f"{exc.start} is a lone surrogate") from None


def is_single_prompt(prompts: Any) -> bool:
    """Is ``generate``'s first argument one prompt (text, a 1-D array, a flat sequence) rather than a list of
    prompts? A 2-D array is refused: pass a list of prompts."""
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, (np.ndarray, torch.Tensor)):
        if prompts.ndim > 1:
            kind = "numpy array" if isinstance(prompts, np.ndarray) else "torch tensor"
            raise InvalidRequestError(f"a {prompts.ndim}-D {kind} is not a prompt; pass a list of prompts "
                                      "(one str, list of token ids or 1-D array each)")
        return True
    if not isinstance(prompts, Sequence) or isinstance(prompts, _TEXTLIKE):
        return True   # not a list of prompts: checked (and refused, naming its type) as one prompt
    if len(prompts) == 0:
        return False  # no prompts
    first = prompts[0]
    return not (isinstance(first, (str, Sequence, np.ndarray)) or (isinstance(first, torch.Tensor) and first.ndim > 0))
