"""How many values a JSON document holds, counted without parsing it, so that a body too costly to parse is refused
before it is parsed.

Parsing JSON into Python objects is one C call that holds the GIL for the whole document, wherever it runs: a 16 MB
body of millions of small numbers held the OpenAI server's event loop for ~0.3 s. The time goes per value, not per
byte (one 16 MB string parses in a few ms), so the count of values is the bound to check. It is counted with numpy
over slices of the body: numpy releases the GIL inside each operation and the interpreter can switch threads between
slices, so the event loop keeps running while a worker counts.

The count is the commas, ``[`` and ``{`` outside strings: an array or object of n > 0 elements has n - 1 commas and
one bracket, so this is the number of elements of all containers, an empty one counting one. A malformed document
gets some count; its parse, which comes next, names the error.
"""

from __future__ import annotations

import numpy as np

SLICE_BYTES = 1 << 20
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_COMMA, _OPEN_ARRAY, _OPEN_OBJECT = ord(","), ord("["), ord("{")


def count_json_values(data: bytes, slice_bytes: int = SLICE_BYTES) -> int:
    """The number of elements of all JSON arrays and objects in ``data`` (an empty one counts one)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    in_string = False   # the state where the previous slice ended
    backslashes = 0     # the run of backslashes the previous slice ended with
    total = 0
    for start in range(0, len(raw), slice_bytes):
        chunk = raw[start:start + slice_bytes]
        structural = (chunk == _COMMA) | (chunk == _OPEN_ARRAY) | (chunk == _OPEN_OBJECT)
        quotes = np.flatnonzero(chunk == _QUOTE)
        escapes = np.flatnonzero(chunk == _BACKSLASH)
        if len(quotes) and (len(escapes) or backslashes):
            quotes = quotes[_unescaped(quotes, escapes, backslashes)]
        if not len(quotes):
            if not in_string:
                total += int(np.count_nonzero(structural))
        else:
            # inside a string when an odd number of quotes precede it, counting the state carried in
            where = np.flatnonzero(structural)
            inside = (np.searchsorted(quotes, where) + in_string) % 2 == 1
            total += len(where) - int(np.count_nonzero(inside))
        in_string = (in_string + len(quotes)) % 2 == 1
        backslashes = _trailing_run(escapes, len(chunk), backslashes)
    return total


def _unescaped(quotes: np.ndarray, escapes: np.ndarray, carried: int) -> np.ndarray:
    """Which quotes are not escaped: the run of backslashes just before each is even (a run that reaches back to
    the slice's start continues the ``carried`` one of the previous slice)."""
    # runs of consecutive backslash positions: where each starts and ends
    breaks = np.flatnonzero(np.diff(escapes) != 1) + 1
    starts = escapes[np.concatenate(([0], breaks))] if len(escapes) else escapes
    ends = escapes[np.concatenate((breaks - 1, [len(escapes) - 1]))] if len(escapes) else escapes
    lengths = ends - starts + 1 + np.where(starts == 0, carried, 0)
    run = np.zeros(len(quotes), dtype=np.int64)
    if len(escapes):
        k = np.searchsorted(ends, quotes - 1)           # the run ending just before the quote, if any
        k = np.minimum(k, len(ends) - 1)
        hit = ends[k] == quotes - 1
        run[hit] = lengths[k[hit]]
    run[quotes == 0] = carried
    return run % 2 == 0


def _trailing_run(escapes: np.ndarray, size: int, carried: int) -> int:
    """The run of backslashes a slice of ``size`` bytes ends with (continuing ``carried`` if it is all of them)."""
    if not len(escapes) or escapes[-1] != size - 1:
        return 0
    breaks = np.flatnonzero(np.diff(escapes) != 1)
    first = int(escapes[breaks[-1] + 1]) if len(breaks) else int(escapes[0])
    return size - first + (carried if first == 0 else 0)
