"""SamplingParams: how one request picks its tokens and when it stops.

Order of logits processing (the sampler implements exactly this, vectorised over the batch):

1. repetition penalty (HF semantics, over prompt + generated tokens: positive logits are divided,
   negative ones multiplied), then presence / frequency penalties (OpenAI semantics, over generated tokens);
2. ``min_tokens``: EOS and ``stop_token_ids`` are masked while fewer tokens have been generated;
3. logprobs are read here (the model's distribution after penalties, before temperature and truncation);
4. ``temperature == 0`` -> greedy argmax; otherwise divide by temperature, keep the ``top_k`` largest,
   then the smallest set whose (renormalised) probability reaches ``top_p``, then drop tokens whose
   probability is below ``min_p`` x the largest; sample from what is left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.contract import ConfigError


@dataclass
class SamplingParams:
    """Per-request options (each field's help says what it does). Invalid values raise ``ConfigError``
    (a ValueError) at construction."""

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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.top_k == -1:
            self.top_k = 0
        problems = []
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1 (or None), got {self.max_tokens}")
        if self.min_tokens < 0:
            problems.append(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 or -1 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            problems.append(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            problems.append(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            problems.append(f"logprobs must be >= 0 or None, got {self.logprobs}")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            raise ConfigError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
