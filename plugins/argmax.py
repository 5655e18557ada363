"""Each row's argmax: the greedy token of a step's logits [rows, vocab].

``torch.argmax`` reads a 32000-wide row on one thread through a generic reduction (~80 us inside a decode step on
Zen 4, where the LM head's two threads each left half of the row in their own core's cache); the C++ kernel
(``plugins/csrc/plugin_ops.cpp``) splits short batches of rows across the threads and scans with vector compares.
Same result as ``torch.argmax(dim=1)``: the first of equal maxima, the first NaN where a row has one.
"""

from __future__ import annotations

import torch

from kiln.plugins.native import define_native_op

__all__ = ["argmax_rows"]


def _argmax_rows_py(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=1)


_lib = torch.library.Library("kiln", "FRAGMENT")
define_native_op(_lib, "argmax_rows", "(Tensor x) -> Tensor", _argmax_rows_py,
                 lambda x: torch.empty(x.shape[0], dtype=torch.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the index of each row's largest value (``torch.ops.kiln.argmax_rows``)."""
    return torch.ops.kiln.argmax_rows(x)
