"""When a request stops: every stop rule in one place, applied after each generated token.

By token (the scheduler's facts): EOS (unless ``ignore_eos``) or one of ``stop_token_ids``, once
``min_tokens`` tokens are out; ``max_tokens`` or the engine's ``max_seq_len`` reached (length).
By text (the detokenized output): the earliest of the ``stop`` strings; the text is cut before it
(or after it with ``include_stop_str_in_output``), and it wins over a token stop of the same step.
"""

from __future__ import annotations

from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sampling_params import SamplingParams

Stop = tuple[RequestStatus, "str | int | None"]   # (finished status, stop reason)


def stop_by_token(req: Request, max_seq_len: int) -> Stop | None:
    """The stop the request's last token causes, if any."""
    token, p = req.output_token_ids[-1], req.params
    if req.num_output_tokens > p.min_tokens:  # at least min_tokens tokens come before a stop token
        if not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_seq_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def stop_hold(params: SamplingParams) -> int:
    """Characters a stream holds back while a stop string could still be completing."""
    return max((len(s) for s in params.stop), default=1) - 1


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
