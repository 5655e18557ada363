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
    """Per-request options. Invalid values raise ``ConfigError`` (a ValueError) at construction.

    max_tokens: tokens to generate at most (``None``: up to the engine's max_seq_len).
    min_tokens: EOS / stop tokens are suppressed until this many tokens are generated.
    temperature: 0 means greedy. top_k: 0 or -1 disables. top_p: 1.0 disables. min_p: 0 disables.
    repetition_penalty: 1.0 disables. presence_penalty / frequency_penalty: 0 disables.
    seed: a per-request generator; the same seed gives the same tokens whatever else is in the batch.
    stop: strings that end generation when they appear in the text; the text is trimmed before them
    (``include_stop_str_in_output`` keeps them). stop_token_ids: extra token ids that end generation.
    ignore_eos: keep generating past EOS. logprobs: return the log-probability of each sampled token
    plus the ``logprobs`` most likely ones (0: sampled token only, None: no logprobs).
    skip_special_tokens: drop special tokens from the text.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

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
