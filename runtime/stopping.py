"""When a request stops: every stop rule in one place, applied after each generated token.

By token (the scheduler's facts): the request's grammar has ended (structured output: it accepted a stop
token, which it allows only where the grammar may end, even with ``ignore_eos``); EOS (unless
``ignore_eos``) or one of ``stop_token_ids``, once ``min_tokens`` tokens are out; ``max_tokens`` or the
engine's ``max_seq_len`` reached (length).
By text (the detokenized output): the earliest of the ``stop`` strings; the text is cut before it
(or after it with ``include_stop_str_in_output``), and it wins over a token stop of the same step.
"""

from __future__ import annotations

from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sampling_params import SamplingParams

Stop = tuple[RequestStatus, "str | int | None"]   # (finished status, stop reason)


def stop_by_token(req: Request, max_seq_len: int, num_output: int | None = None) -> Stop | None:
    """The stop the request's last token causes, if any; with ``num_output``, the stop its token at that
    count causes (speculative decoding appends several tokens in one step, and a stop drops those after it)."""
    n = req.num_output_tokens if num_output is None else num_output
    token, p = req.output_token_ids[n - 1], req.params
    if req.grammar is not None and req.grammar.terminated:
        return RequestStatus.FINISHED_STOPPED, token if token in p.stop_token_ids else None
    if n > p.min_tokens:  # at least min_tokens tokens come before a stop token
        if not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if n >= req.max_tokens or req.num_prompt_tokens + n >= max_seq_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


class StopHold:
    """How much of a growing text a stream holds back: the longest suffix that is a proper prefix of some
    stop string (it may still become one); text that cannot start a stop string is released at once.

    A Knuth-Morris-Pratt automaton per stop string is fed only the new characters, so each step costs what
    it adds, however long the stop strings are (re-matching every suffix would cost their length squared
    per token, a stall of the whole step loop with one long stop string)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.fallback = [_prefix_function(s) for s in stops]
        self.matched = [0] * len(stops)   # per stop string: length of the longest suffix that is its prefix

    def feed(self, new_text: str) -> None:
        for j, s in enumerate(self.stops):
            k, fallback = self.matched[j], self.fallback[j]
            for ch in new_text:
                if k == len(s):
                    k = fallback[k - 1]
                while k and s[k] != ch:
                    k = fallback[k - 1]
                if s[k] == ch:
                    k += 1
            self.matched[j] = k

    @property
    def held(self) -> int:
        # a whole stop string matched (the stream ends there): its longest proper prefix that is a suffix
        return max((k if k < len(s) else f[k - 1] for k, s, f in zip(self.matched, self.stops, self.fallback)),
                   default=0)


def _prefix_function(s: str) -> list[int]:
    """pi[i] = length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


def stop_hold(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` a stream holds back (see :class:`StopHold`)."""
    hold = StopHold(stops)
    hold.feed(text)
    return hold.held


def cut_at_stop_string(text: str, params: SamplingParams, searched: int) -> tuple[str, str] | None:
    """(text cut at the earliest stop string, that string), looking from a little before ``searched``
    (the length of text already searched: a stop string may straddle it); None when none is there."""
    if not params.stop:
        return None
    lo = max(0, searched - max(len(s) for s in params.stop))
    best: tuple[int, str] | None = None
    for s in params.stop:
        k = text.find(s, lo)
        if k >= 0 and (best is None or k < best[0]):
            best = (k, s)
    if best is None:
        return None
    k, s = best
    return (text[:k + len(s)] if params.include_stop_str_in_output else text[:k]), s
