"""SamplingParams: how one request picks its tokens and when it stops.

Order of logits processing (the sampler implements exactly this, vectorised over the batch):

1. repetition penalty (HF semantics, over prompt + generated tokens: positive logits are divided,
   negative ones multiplied), then presence / frequency penalties (OpenAI semantics, over generated tokens);
2. ``min_tokens``: EOS and ``stop_token_ids`` are masked while fewer tokens have been generated;
   ``structured_output``: every token its grammar does not allow next is masked (``kiln.runtime.grammar``);
3. logprobs are read here (the model's distribution after penalties, before temperature and truncation);
4. ``temperature == 0`` -> greedy argmax; otherwise divide by temperature, keep the ``top_k`` largest,
   then the smallest set whose (renormalised) probability reaches ``top_p``, then drop tokens whose
   probability is below ``min_p`` x the largest; sample from what is left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.contract import ConfigError, reject_unknown_options
from kiln.runtime.fields import SEED_RANGE, FieldChecks, is_integer
from kiln.runtime.structured_output import StructuredOutputParams


@reject_unknown_options()
@dataclass
class SamplingParams:
    """Per-request options (each field's help says what it does). Every field is checked for type and range
    at construction (see ``kiln.runtime.fields``: integers are not floats or bools, numbers are finite, flags
    are bools, ``stop`` is a string or a list of strings, ``seed`` fits a 64-bit generator seed); a bad value
    raises ``ConfigError`` (a ValueError) naming the field and what it accepts. Limits that depend on the
    engine (token ids and ``logprobs`` within the vocabulary) are checked at submission."""

    max_tokens: int | None = field(default=16, metadata={
        "help": "Tokens to generate at most (Python API: None = up to the engine's max_seq_len)."})
    min_tokens: int = field(default=0, metadata={
        "help": "EOS and stop token ids are suppressed until this many tokens are generated."})
    temperature: float = field(default=1.0, metadata={"help": "0 means greedy."})
    top_k: int = field(default=0, metadata={"help": "Keep the k most likely tokens (0 or -1: all)."})
    top_p: float = field(default=1.0, metadata={
        "help": "Keep the smallest set of tokens whose probability reaches top_p (1.0: all)."})
    min_p: float = field(default=0.0, metadata={
        "help": "Drop tokens less likely than min_p x the most likely one (0: none)."})
    repetition_penalty: float = field(default=1.0, metadata={
        "help": "Penalty on tokens of the prompt and output (HF semantics; 1.0: none)."})
    presence_penalty: float = field(default=0.0, metadata={
        "help": "Subtracted from tokens already generated (OpenAI semantics; 0: none)."})
    frequency_penalty: float = field(default=0.0, metadata={
        "help": "Subtracted per occurrence in the output (OpenAI semantics; 0: none)."})
    seed: int | None = field(default=None, metadata={
        "help": "Per-request seed: the same seed gives the same tokens whatever else is in the batch."})
    stop: list[str] | str | None = field(default=None, metadata={
        "help": "Stop string (repeatable): generation ends when it appears; the text is cut before it."})
    stop_token_ids: list[int] = field(default_factory=list, metadata={
        "help": "Token id that ends generation (repeatable)."})
    include_stop_str_in_output: bool = field(default=False, metadata={
        "help": "Keep the stop string at the end of the text."})
    ignore_eos: bool = field(default=False, metadata={"help": "Keep generating past EOS."})
    logprobs: int | None = field(default=None, metadata={
        "help": "Return the log-probability of each sampled token and of the N most likely ones "
                "(0: the sampled token only)."})
    skip_special_tokens: bool = field(default=True, metadata={"help": "Drop special tokens from the text."})
    structured_output: StructuredOutputParams | dict | None = field(default=None, metadata={
        "help": "The shape the output must have: a StructuredOutputParams (or a dict of its fields) with one of "
                "json (a JSON schema), json_object, regex, choice, grammar (EBNF) or structural_tag; the output "
                "then ends (finish_reason stop) only where the grammar may end."})

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Check (and normalise) every field; ConfigError lists each bad one with its allowed range. Run at
        construction and again at submission (a field may have been changed since)."""
        c = FieldChecks()
        self.max_tokens = c.integer("max_tokens", self.max_tokens, 1, optional=True)
        self.min_tokens = c.integer("min_tokens", self.min_tokens, 0)
        self.temperature = c.number("temperature", self.temperature, 0)
        self.top_k = c.integer("top_k", self.top_k, -1)
        if self.top_k == -1:
            self.top_k = 0
        self.top_p = c.number("top_p", self.top_p, 0, 1, lo_open=True)
        self.min_p = c.number("min_p", self.min_p, 0, 1)
        self.repetition_penalty = c.number("repetition_penalty", self.repetition_penalty, 0, lo_open=True)
        self.presence_penalty = c.number("presence_penalty", self.presence_penalty, -2, 2)
        self.frequency_penalty = c.number("frequency_penalty", self.frequency_penalty, -2, 2)
        self.seed = c.integer("seed", self.seed, *SEED_RANGE, optional=True)
        self.stop = self._stop_strings(c)
        self.stop_token_ids = self._stop_token_ids(c)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            setattr(self, name, c.flag(name, getattr(self, name)))
        self.logprobs = c.integer("logprobs", self.logprobs, 0, optional=True)
        if is_integer(self.max_tokens) and is_integer(self.min_tokens) and self.min_tokens > self.max_tokens:
            c.problems.append(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        try:
            self.structured_output = StructuredOutputParams.of(self.structured_output)
        except ConfigError as exc:
            c.problems.append(str(exc))
        if self.structured_output is not None and is_integer(self.min_tokens) and self.min_tokens > 0:
            c.problems.append("min_tokens cannot be combined with structured_output: the grammar decides where the "
                              "output may end; set min_tokens=0")
        if c.problems:
            raise ConfigError("invalid SamplingParams: " + "; ".join(c.problems))

    def _stop_strings(self, c: FieldChecks) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            return []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            c.problems.append(f"stop must be a string or a list of strings, got {stop!r:.60}")
            return self.stop
        if not all(stop):
            c.problems.append("stop strings must be non-empty")
        return list(stop)

    def _stop_token_ids(self, c: FieldChecks) -> list[int]:
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(is_integer(t) and t >= 0 for t in ids):
            c.problems.append(f"stop_token_ids must be a list of integers >= 0, got {ids!r:.60}")
            return ids
        return [int(t) for t in ids]

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
