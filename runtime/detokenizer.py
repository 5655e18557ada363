"""Incremental detokenization: text deltas as tokens arrive, correct when a character spans tokens.

A byte-level BPE token can end in the middle of a multi-byte UTF-8 character (an emoji, CJK); decoding it
alone gives U+FFFD. The detokenizer decodes a short window of recent tokens and only releases text once the
window decodes cleanly (or 4 tokens have passed: then the bytes are invalid, not incomplete), so the
concatenated deltas equal the decode of all tokens at once. A few prompt tokens seed the window, so
tokenizers that strip a leading space from the first token (SentencePiece's "▁") still give the first
generated token its space.
"""

from __future__ import annotations

from pathlib import Path

_CONTEXT = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT:])
        if self._decode(self.ids).endswith("\ufffd"):
            self.ids = []  # the prompt ends inside a character: its tail would shift every offset
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def step(self, token_ids: list[int]) -> str:
        """Add tokens, return the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        # a trailing U+FFFD may be a character still arriving (UTF-8 needs at most 4 bytes, so at most 4 tokens);
        # after that it is an invalid byte the model produced, and is released as it is
        pending = full.endswith("\ufffd") and len(self.ids) - self.read_offset < 4
        if len(full) > len(prefix) and not pending:
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end) when the request finishes."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


def load_tokenizer(engine_dir: str | Path):
    """The engine directory's tokenizer.json as a ``tokenizers.Tokenizer`` (None if there is none);
    EngineLoadError naming the file when it cannot be read."""
    from tokenizers import Tokenizer

    from kiln.contract import EngineLoadError

    path = Path(engine_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception ("EOF while parsing ...")
        raise EngineLoadError(f"{path}: not a readable tokenizer ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
                              "copy tokenizer.json from the checkpoint again or rebuild the engine") from None
