"""Structured output's grammar side, on xgrammar: the engine's vocabulary as byte strings, grammars parsed
at submission and compiled off the step loop, one matcher per request, and the token bitmask of a step.

* ``GrammarCompiler.prepare`` / ``.claim`` parse a constraint in the caller's thread (an invalid schema, regex
  or grammar is an ``InvalidRequestError`` there, before anything is queued); compiling it against the
  vocabulary (the expensive part: a token mask per grammar state) runs in a small thread pool whose
  threads are scheduled SCHED_IDLE (``COMPILE_PRIORITY``), so that a large schema takes the step loop's
  idle time rather than its cores. Compiled grammars are kept in an LRU cache by ``StructuredOutputParams.cache_key``; a
  request whose grammar is still compiling waits (the executor holds it back) while the others step.
* ``RequestGrammar`` is a request's matcher: it accepts each generated token, can roll tokens back (for
  speculative decoding's rejected drafts), and knows when the grammar has ended. Its state is the tokens it
  accepted, so it survives preemption (recompute replays the KV cache, not the matcher).
* ``apply_grammar_masks`` fills one bitmask row per constrained request of a step (xgrammar's matcher) and
  sets the logits of disallowed tokens to -inf (xgrammar's CPU kernel).

Special tokens of the tokenizer are never allowed, except the stop tokens (EOS and the request's
``stop_token_ids``), which are allowed exactly where the grammar may end.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kiln.contract import InvalidRequestError
from kiln.runtime.structured_output import StructuredOutputParams

if TYPE_CHECKING:
    from kiln.runtime.metrics import RuntimeMetrics
    from kiln.runtime.request import Request

logger = logging.getLogger("kiln.runtime")

# How the compile threads are scheduled: "idle" (Linux SCHED_IDLE: they run on what the step loop leaves
# idle, and yield a core at once when it wants it back), a nice increment (an int), or None (as any thread)
COMPILE_PRIORITY: str | int | None = "idle"
_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: ")


def xgrammar():
    """The xgrammar module, or InvalidRequestError saying how to install it."""
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError("structured output needs xgrammar: pip install 'kiln-llm[structured]'") from None
    return xgrammar


# ---- the vocabulary ---------------------------------------------------------------------------------------
def _decoder_types(node: dict | None) -> list[str]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [t for child in node.get("decoders", []) for t in _decoder_types(child)]
    return [node.get("type", "")]


def vocabulary_metadata(tokenizer) -> tuple[str, bool]:
    """(vocab type, add_prefix_space) of a ``tokenizers.Tokenizer``, read off its tokenizer.json:
    "BYTE_LEVEL" when the decoder maps bytes to characters (GPT-2 style, ``Ġ`` for a space),
    "BYTE_FALLBACK" when it spells unknown bytes ``<0xXX>`` or writes spaces as ``▁`` (SentencePiece style),
    else "RAW"; add_prefix_space when the pre-tokenizer or normalizer puts a ``▁`` before the text."""
    spec = json.loads(tokenizer.to_str())
    decoders = _decoder_types(spec.get("decoder"))
    if "ByteLevel" in decoders:
        vocab_type = "BYTE_LEVEL"
    elif "ByteFallback" in decoders or "Metaspace" in decoders or "Replace" in decoders:
        vocab_type = "BYTE_FALLBACK"
    else:
        vocab_type = "RAW"
    text = json.dumps([spec.get("pre_tokenizer"), spec.get("normalizer")])
    prefix = ('"Metaspace"' in text and '"prepend_scheme": "never"' not in text
              and '"add_prefix_space": false' not in text) or '"prepend": "\\u2581"' in text
    return vocab_type, prefix


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the engine's vocabulary: ``vocab_size`` entries (the model's, which may differ
    from the tokenizer's), special tokens and ids the tokenizer lacks blanked (xgrammar never allows
    an empty token, except a stop token)."""
    xgr = xgrammar()
    encoded = [""] * vocab_size
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = token
    for i, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            encoded[i] = ""
    vocab_type, prefix = vocabulary_metadata(tokenizer)
    return xgr.TokenizerInfo(encoded, getattr(xgr.VocabType, vocab_type), vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=prefix)


# ---- parsing and compiling --------------------------------------------------------------------------------
def _message(exc: Exception) -> str:
    text = _LOG_PREFIX.sub("", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# xgrammar's character class for the characters of a string with minLength/maxLength lets the control
# characters U+0000-U+001F through, which JSON forbids unescaped; the grammar's text is rewritten to exclude them
_STRING_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARS = '[^\\0-\\x1f\\"\\\\]'


def parse_grammar(spec: StructuredOutputParams):
    """The xgrammar Grammar of a constraint; InvalidRequestError naming what is wrong with it."""
    xgr = xgrammar()
    kind, text = spec.kind, spec.text
    any_whitespace = spec.any_whitespace
    try:
        if kind == "json":
            check_json_schema(text)
            grammar = xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        elif kind == "json_object":
            grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        elif kind == "regex":
            check_regex(text)
            return xgr.Grammar.from_regex(text)
        elif kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in spec.choice))
        elif kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
        else:
            grammar = _structural_tag(xgr, text)
    except InvalidRequestError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError (its C++ checks), ValueError, TypeError, its own
        what = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice list",
                "grammar": "EBNF grammar", "structural_tag": "structural tag"}[kind]
        raise InvalidRequestError(f"invalid {what} in structured_output.{kind}: {_message(exc)}") from None
    ebnf = str(grammar)
    return xgr.Grammar.from_ebnf(ebnf.replace(_STRING_CHARS, _JSON_STRING_CHARS)) if _STRING_CHARS in ebnf else grammar


# ---- what xgrammar would accept but not enforce -----------------------------------------------------------
# A grammar that ignores a keyword produces outputs that do not validate; such schemas are refused instead.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems")
_NOT_ENFORCED = {
    "not": "'not'", "contains": "'contains'", "minContains": "'minContains'", "maxContains": "'maxContains'",
    "dependentSchemas": "'dependentSchemas'", "if": "'if'/'then'/'else'",
}


def check_json_schema(text: str) -> None:
    """InvalidRequestError if the schema is not JSON, not a schema, or uses a keyword the grammar would not
    enforce (so outputs could fail validation): not, contains, if/then/else, dependentSchemas, uniqueItems,
    allOf with several subschemas, a string pattern together with minLength/maxLength."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"structured_output.json is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("structured_output.json must be a JSON schema (an object), "
                                  f"got {type(schema).__name__}")
    problems: list[str] = []
    _walk_schema(schema, "#", problems)
    if problems:
        raise InvalidRequestError("structured_output.json uses what the grammar engine (xgrammar) would not enforce, "
                                  "so outputs could fail validation: " + "; ".join(problems[:5])
                                  + ". Remove or rewrite these keywords")


def _walk_schema(node: Any, path: str, problems: list[str]) -> None:
    if not isinstance(node, dict):
        return
    for key, name in _NOT_ENFORCED.items():
        if key in node:
            problems.append(f"{name} at {path}")
    if node.get("uniqueItems") is True:
        problems.append(f"'uniqueItems' at {path}")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        problems.append(f"'allOf' with {len(node['allOf'])} subschemas at {path} (merge them into one)")
    if "pattern" in node and ("minLength" in node or "maxLength" in node):
        problems.append(f"'pattern' with 'minLength'/'maxLength' at {path} (put the length in the pattern, "
                        "e.g. [a-z]{2,8})")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _walk_schema(sub, f"{path}/{key}/{name}", problems)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _walk_schema(sub, f"{path}/{key}/{i}", problems)
    for key in _SUBSCHEMAS:
        if isinstance(node.get(key), dict):
            _walk_schema(node[key], f"{path}/{key}", problems)
    if isinstance(node.get("items"), list):   # draft 4-7 tuple form
        for i, sub in enumerate(node["items"]):
            _walk_schema(sub, f"{path}/items/{i}", problems)


_LOOKAROUND = re.compile(r"\\(?:[1-9]|k<)|\(\?<?[=!]")


def check_regex(text: str) -> None:
    """InvalidRequestError for lookarounds and backreferences, which xgrammar ignores (the output could then
    fail to match)."""
    match = _LOOKAROUND.search(text.replace("\\\\", ""))
    if match:
        raise InvalidRequestError(f"structured_output.regex uses {match.group()!r} (a lookaround or a backreference), "
                                  "which the grammar engine (xgrammar) does not enforce; rewrite the regex without it")


def _structural_tag(xgr, text: str):
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"structured_output.structural_tag is not valid JSON: {exc}") from None
    if isinstance(tag, dict) and "structures" in tag:   # vLLM's legacy form: begin/schema/end items + triggers
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not (isinstance(structures, list) and isinstance(triggers, list)
                and all(isinstance(s, dict) and set(s) >= {"begin", "end"} for s in structures)):
            raise InvalidRequestError("structured_output.structural_tag: the legacy form takes 'structures' "
                                      "(a list of {begin, schema, end}) and 'triggers' (a list of strings)")
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                 for s in structures]
        return xgr.Grammar.from_structural_tag(items, triggers)
    return xgr.Grammar.from_structural_tag(text)


@dataclass
class _Entry:
    compiled: Future      # of the CompiledGrammar
    claimed: bool = False  # a submitted request uses it (validation alone compiles without claiming)


class GrammarCompiler:
    """Parses constraints (caller's thread), compiles them (a thread pool) and caches the results (LRU by
    ``cache_key``); counts cache hits and misses and times compiles into ``metrics``."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], metrics: RuntimeMetrics, *,
                 cache_size: int = 256, threads: int = 1):
        xgr = xgrammar()
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.metrics = metrics
        self.cache_size = cache_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kiln-grammar",
                                        initializer=_lower_priority)

    def prepare(self, spec: StructuredOutputParams) -> Future:
        """Parse ``spec`` (InvalidRequestError if it is invalid) and start compiling it unless it is cached;
        the compiled grammar's Future. Counts nothing: validation calls this before submission does."""
        return self._entry(spec).compiled

    def claim(self, spec: StructuredOutputParams) -> Future:
        """``prepare`` for a request being submitted: a cache hit when an earlier request claimed the same
        grammar, else a miss (it was compiled for this one)."""
        entry = self._entry(spec)
        with self._lock:
            hit, entry.claimed = entry.claimed, True
        self.metrics.incr("grammar_cache_hits" if hit else "grammar_cache_misses")
        return entry.compiled

    def _entry(self, spec: StructuredOutputParams) -> _Entry:
        key = spec.cache_key
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry
        grammar = parse_grammar(spec)   # outside the lock: a large schema takes milliseconds
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:   # (another thread may have parsed the same one meanwhile)
                entry = self._cache[key] = _Entry(self._pool.submit(self._compile, grammar))
                entry.compiled.add_done_callback(lambda f, key=key: self._forget_failed(key, f))
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return entry

    def _compile(self, grammar):
        start = time.perf_counter()
        compiled = self._compiler.compile_grammar(grammar)
        self.metrics.observe("grammar_compile_time", time.perf_counter() - start)
        return compiled

    def _forget_failed(self, key: tuple, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                entry = self._cache.get(key)
                if entry is not None and entry.compiled is future:
                    del self._cache[key]

    def matcher(self, compiled, extra_stop_token_ids: list[int]) -> RequestGrammar:
        """A fresh matcher of a compiled grammar for one request (its stop token ids end it too)."""
        stops = self.stop_token_ids + [t for t in extra_stop_token_ids if t not in self.stop_token_ids]
        return RequestGrammar(xgrammar().GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                                        terminate_without_stop_token=not stops))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """Pool thread initializer: this thread only (Linux schedules threads apart) at COMPILE_PRIORITY;
    where SCHED_IDLE is not available, the lowest nice value instead."""
    tid = threading.get_native_id()
    try:
        if COMPILE_PRIORITY == "idle":
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                return
            except (AttributeError, OSError):
                os.setpriority(os.PRIO_PROCESS, tid, 19)
        elif COMPILE_PRIORITY is not None:
            os.setpriority(os.PRIO_PROCESS, tid, COMPILE_PRIORITY)
    except (AttributeError, OSError):   # not Linux, or not allowed: compile at normal priority
        pass


# ---- one request's matcher --------------------------------------------------------------------------------
class RequestGrammar:
    """The matcher of one request (``Request.grammar``): accept tokens, roll them back, say when it ended."""

    __slots__ = ("matcher", "num_accepted")

    def __init__(self, matcher: Any):
        self.matcher = matcher
        self.num_accepted = 0

    def accept(self, token: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it (the state is unchanged)."""
        ok = self.matcher.accept_token(token)
        self.num_accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding's rejected drafts)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} were accepted")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    @property
    def terminated(self) -> bool:
        """The grammar ended (a stop token was accepted, or the grammar is complete and has no stop token)."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


# ---- the step's masks -------------------------------------------------------------------------------------
class GrammarMasks:
    """The bitmask buffer of the sampler (grown to the largest batch seen) and the masking of one step."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.bitmask: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Disallowed tokens of every constrained row at -inf (in place when it can be: ``logits`` is the
        sampler's own copy or the engine's output, which nothing reads after sampling)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.grammar.terminated]
        if not rows:
            return logits
        xgr = xgrammar()
        batch = logits.shape[0]
        if self.bitmask is None or self.bitmask.shape[0] < batch:
            self.bitmask = xgr.allocate_token_bitmask(batch, self.vocab_size)
        bitmask = self.bitmask[:batch]
        for i in rows:
            reqs[i].grammar.fill(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        return logits
