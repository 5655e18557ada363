"""Cheap bounds on a prompt before it is tokenized, and tokenization that lets other threads run.

Tokenizing megabytes of text takes seconds and hundreds of MB, so both frontends refuse a prompt that cannot
fit the engine by its size first:

- text: if no token covers more than ``L`` bytes of the text, a prompt of ``B`` bytes has at least ``B / L``
  tokens, so ``B > max_input_len x L`` is refused without tokenizing. ``L`` is the longest token of the
  vocabulary as stored in tokenizer.json (at least 4, one UTF-8 character): stored forms are never shorter than
  what they cover (a byte-level token has one character per byte, ``▁`` stands for a one-byte space,
  ``<0x41>`` for one byte). That holds only if nothing before the model drops or shrinks text, which
  :func:`max_bytes_per_token` checks on the tokenizer's pipeline; Unicode normalization and lowercasing can
  shrink a character of up to 4 bytes to 1, so they multiply ``L`` by 4. A tokenizer it cannot vouch for
  (one that strips, drops whitespace or unknown text, truncates, or uses WordPiece/Unigram) gets no byte bound:
  its prompts are only tokenized off the event loop.
- token ids: a list longer than ``max_input_len`` is refused by its length, before its ids are looked at;
- the whole request: at most ``MAX_REQUEST_BYTES``, on both frontends.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# The largest request either frontend reads: an OpenAI request's body, a Triton request's input tensors
MAX_REQUEST_BYTES = 16 << 20

# pre-tokenizer steps that keep every character; normalizers that map each character to one or more characters
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}
_CHARWISE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}


def _normalizer_steps(node: dict | None, ratios: list[float]) -> bool | None:
    """Walk a normalizer: whether it has character-wise steps (None: a step that can drop text); appends each
    Replace's shrink ratio (pattern over replacement, in characters or bytes, the larger) to ``ratios``."""
    if node is None:
        return False
    kind = node.get("type")
    if kind == "Sequence":
        charwise = False
        for step in node.get("normalizers", []):
            found = _normalizer_steps(step, ratios)
            if found is None:
                return None
            charwise |= found
        return charwise
    if kind == "Replace":
        pattern, content = node.get("pattern", {}), node.get("content", "")
        if "String" not in pattern or not content:   # a regex, or a deletion: no bound
            return None
        old = pattern["String"]
        ratios.append(max(1.0, len(old) / len(content), len(old.encode()) / len(content.encode())))
        return False
    if kind == "Prepend":
        return False
    return True if kind in _CHARWISE_NORMALIZERS else None


def _normalizer_factor(node: dict | None) -> float | None:
    """How many times fewer UTF-8 bytes the normalized text can have than the original (None: unbounded). A
    character-wise step turns each character (at most 4 bytes) into at least one (at least 1 byte), so however
    many of them there are they shrink bytes at most 4 times; each Replace shrinks by its ratio."""
    ratios: list[float] = []
    charwise = _normalizer_steps(node, ratios)
    if charwise is None:
        return None
    return (4.0 if charwise else 1.0) * math.prod(ratios)


def _pre_tokenizer_keeps_text(node: dict | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(step) for step in node.get("pretokenizers", []))
    if kind == "Split":
        return node.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _has_byte_level(node: dict | None) -> bool:
    if node is None:
        return False
    if node.get("type") == "Sequence":
        return any(_has_byte_level(step) for step in node.get("pretokenizers", []))
    return node.get("type") == "ByteLevel"


def max_bytes_per_token(tokenizer) -> int | None:
    """The most bytes of original text one token of ``tokenizer`` (a ``tokenizers.Tokenizer``) can stand for,
    or None when its pipeline can drop or arbitrarily shrink text (then no byte bound is safe)."""
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if spec.get("truncation") is not None or model.get("type") != "BPE" or model.get("fuse_unk"):
        return None
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer")):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if model.get("unk_token") is None and not model.get("byte_fallback"):
        # unknown characters would be dropped: only a byte-level vocabulary with every byte has none
        from tokenizers import pre_tokenizers

        if not (_has_byte_level(spec.get("pre_tokenizer")) and set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab)):
            return None
    longest = max((len(token.encode("utf-8")) for token in vocab), default=1)
    return math.ceil(max(longest, 4) * factor)


@dataclass(frozen=True)
class PromptBounds:
    """What an engine can take, checked before tokenizing: ``max_text_bytes`` is None without a byte bound."""

    max_input_len: int
    max_text_bytes: int | None

    @classmethod
    def of(cls, tokenizer, max_input_len: int) -> PromptBounds:
        per_token = max_bytes_per_token(tokenizer) if tokenizer is not None else None
        return cls(max_input_len, None if per_token is None else max_input_len * per_token)

    def text_problem(self, text: str) -> str | None:
        """Why ``text`` cannot fit the engine, judged by its size alone; None if it may."""
        if self.max_text_bytes is None or len(text) <= self.max_text_bytes // 4:
            return None   # a character is at most 4 bytes: no need to measure
        if len(text) > self.max_text_bytes:   # and at least 1: no need to measure either
            size, at_least = len(text), "at least "
        else:
            size, at_least = len(text.encode("utf-8", "surrogatepass")), ""
        if size <= self.max_text_bytes:
            return None
        return (f"the prompt is {at_least}{size} bytes, more than this engine's max_input_len ({self.max_input_len} "
                f"tokens) can hold with its tokenizer (at most {self.max_text_bytes} bytes); shorten it")

    def ids_problem(self, num_ids: int) -> str | None:
        if num_ids <= self.max_input_len:
            return None
        return (f"the prompt has {num_ids} tokens, more than this engine's max_input_len {self.max_input_len}; "
                "shorten it")


def tokenize(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text).ids``, through the batch call without offsets where ``tokenizers`` has it
    (0.21+): it holds the GIL for less of the time, so the event loop and the other threads keep running while a
    long prompt is tokenized (docs/serving-security.md has the measurement)."""
    fast = getattr(tokenizer, "encode_batch_fast", None)
    if fast is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    return fast([text], add_special_tokens=add_special_tokens)[0].ids
