"""The output side of one request: its detokenized text, what was already handed out, its callback."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.stopping import StopHold, cut_at_stop_string

logger = logging.getLogger("kiln.runtime")


@dataclass
class OutputStream:
    params: SamplingParams
    callback: Callable[[RequestOutput], None] | None
    detok: IncrementalDetokenizer | None
    hold: StopHold = field(init=False)   # the tail held back while a stop string could still be completing
    text: str = ""
    sent_tokens: int = 0
    sent_text: int = 0
    flushed: bool = False
    error: str | None = None

    def __post_init__(self) -> None:
        self.hold = StopHold(self.params.stop)

    @classmethod
    def open(cls, req: Request, tokenizer, callback: Callable[[RequestOutput], None] | None) -> OutputStream:
        detok = (IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)
                 if tokenizer is not None else None)
        return cls(req.params, callback, detok)

    def add_token(self, token: int, last: bool) -> str | None:
        """Detokenize one generated token (flushing the held-back tail when it is the ``last``); returns the
        stop string the text now contains, having cut the text there, or None."""
        if self.detok is None:
            return None
        searched = len(self.text)
        self._add_text(self.detok.step([token]))
        if last:
            self.flush()
        cut = cut_at_stop_string(self.text, self.params, searched)
        if cut is None:
            return None
        self.text, stop = cut
        self.flushed = True  # text after a stop string is never shown
        return stop

    def flush(self) -> None:
        if self.detok is not None and not self.flushed:
            self._add_text(self.detok.flush())
        self.flushed = True

    def _add_text(self, text: str) -> None:
        self.text += text
        self.hold.feed(text)

    def output(self, req: Request, final: bool) -> RequestOutput:
        """The request's state now, with what is new since the last output (``final``: nothing held back;
        otherwise the tail that could still become a stop string is held)."""
        end = len(self.text) if final else max(self.sent_text, len(self.text) - self.hold.held)
        out = RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=self.text[:end],
            finish_reason=req.status.value if final else None, metrics=req.metrics,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            delta_token_ids=req.output_token_ids[self.sent_tokens:],
            delta_text=self.text[self.sent_text:end], stop_reason=req.stop_reason, error=self.error,
        )
        self.sent_tokens = req.num_output_tokens
        self.sent_text = end
        return out

    def send(self, req: Request, final: bool = False) -> None:
        out = self.output(req, final)
        if self.callback is not None:
            try:
                self.callback(out)
            except Exception:
                logger.exception("output callback of %s failed", req.request_id)
