"""The accuracy report of an 8-bit KV cache: what int8 / fp8 keys and values cost against the engine dtype's.

The model (the engine's graph after the builder's passes: its own kernels; only the pool differs) runs the
same calibration sequences twice, once over a pool of the engine dtype and once over the 8-bit pool, on the
runtime's schedule: the first half of every sequence as one mixed prefill step (context chunks), then the rest
one token per sequence per step (decode, teacher forced), so both the context path and the decode kernel
read the quantized pool. Every position's logits are compared: max and mean absolute error, and how often
the top-1 token (the greedy choice) agrees.

Calibration sequences: the paragraphs of ``--kv-calibration FILE`` (separated by blank lines, tokenized with
the checkpoint's tokenizer.json), or, by default, text the checkpoint writes itself: continuations sampled
(seeded, temperature 1) from a few one-token seeds over the engine-dtype pool.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from kiln.contract import KV_CACHE_DTYPES, BuildConfigError, ModelConfig, SeqChunk, kv_cache_shape, pack_inputs

MAX_PROMPTS = 16            # paragraphs of a calibration file used
MAX_PROMPT_TOKENS = 256     # tokens of each (and at most max_seq_len)
OWN_TEXT_PROMPTS = 4        # sequences the checkpoint writes when no file is given
OWN_TEXT_TOKENS = 64        # tokens of each
SEED = 0


def calibration_file_prompts(path: str | Path, ckpt: Path, max_len: int) -> list[list[int]]:
    """Token ids of the file's paragraphs; BuildConfigError naming what is missing."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BuildConfigError(f"kv_calibration {path}: cannot read it as UTF-8 text ({exc}); give a text file of "
                               "prompts separated by blank lines") from None
    if not (ckpt / "tokenizer.json").is_file():
        raise BuildConfigError(f"kv_calibration {path}: the checkpoint {ckpt} has no tokenizer.json to tokenize it "
                               "with; drop kv_calibration (the report then uses text the checkpoint writes)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    paragraphs = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]
    prompts = [ids[:max_len] for ids in (tok.encode(p).ids for p in paragraphs[:MAX_PROMPTS]) if len(ids) >= 2]
    if not prompts:
        raise BuildConfigError(f"kv_calibration {path}: no paragraph of at least 2 tokens; give a text file of "
                               "prompts separated by blank lines")
    return prompts


class _Stepper:
    """Runs packed steps of the module over one pool (each sequence its own blocks)."""

    def __init__(self, module: torch.nn.Module, model: ModelConfig, kv_dtype: str, lengths: list[int], block: int):
        self.module, self.block = module, block
        need = [-(-n // block) for n in lengths]
        starts = [sum(need[:i]) for i in range(len(need))]
        self.tables = [list(range(s, s + n)) for s, n in zip(starts, need)]
        self.pool = torch.zeros(kv_cache_shape(model, block, max(sum(need), 1), kv_dtype),
                                dtype=KV_CACHE_DTYPES[kv_dtype])

    def step(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """chunks: (sequence, new tokens, tokens already in the pool), context chunks first; logits of every
        new token [sum of new tokens, vocab] (float32)."""
        packed = pack_inputs([SeqChunk(toks, start, self.tables[s], len(toks)) for s, toks, start in chunks],
                             self.pool, self.block)
        with torch.no_grad():
            out = self.module(**packed)
        if isinstance(out, tuple):   # after functional_kv (onnx): the graph returns the pool it wrote
            out, self.pool = out
        return out.float()


def own_text(module: torch.nn.Module, model: ModelConfig, kv_dtype: str, bos: int | None, max_len: int,
             block: int) -> list[list[int]]:
    """Sequences the model writes from one-token seeds spread over the vocabulary (seeded sampling)."""
    n = min(OWN_TEXT_TOKENS, max_len)
    seeds = [([bos] if bos is not None else []) + [model.vocab_size * (i + 1) // (OWN_TEXT_PROMPTS + 1)]
             for i in range(OWN_TEXT_PROMPTS)]
    seqs = [list(s)[: n - 1] for s in seeds]
    run = _Stepper(module, model, kv_dtype, [n] * len(seqs), block)
    g = torch.Generator().manual_seed(SEED)
    logits = run.step([(i, s, 0) for i, s in enumerate(seqs)])
    rows = logits[torch.cumsum(torch.tensor([len(s) for s in seqs]), 0) - 1]   # each seed's last position
    while True:
        for s, t in zip(seqs, torch.multinomial(torch.softmax(rows, -1), 1, generator=g)[:, 0].tolist()):
            s.append(t)
        if len(seqs[0]) >= n:
            return seqs
        rows = run.step([(i, [s[-1]], len(s) - 1) for i, s in enumerate(seqs)])


def teacher_forced_logits(module: torch.nn.Module, model: ModelConfig, kv_dtype: str, prompts: list[list[int]],
                          block: int) -> list[torch.Tensor]:
    """Logits of every position of each prompt but the last: the first half in one prefill step (every
    prompt a context chunk), then one token per prompt per step."""
    run = _Stepper(module, model, kv_dtype, [len(p) for p in prompts], block)
    split = [max(1, len(p) // 2) for p in prompts]
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    logits = run.step([(i, p[: split[i]], 0) for i, p in enumerate(prompts)])
    row = 0
    for i in range(len(prompts)):
        out[i].append(logits[row: row + split[i]])
        row += split[i]
    for pos in range(min(split), max(len(p) for p in prompts) - 1):
        live = [i for i, p in enumerate(prompts) if split[i] <= pos < len(p) - 1]
        if not live:
            continue
        logits = run.step([(i, [prompts[i][pos]], pos) for i in live])
        for r, i in enumerate(live):
            out[i].append(logits[r: r + 1])
    return [torch.cat(rows)[: len(p) - 1] for rows, p in zip(out, prompts)]


def max_prompt_len(build: Any) -> int:
    return min(build.max_seq_len, MAX_PROMPT_TOKENS)


def kv_accuracy(module: torch.nn.Module, model: ModelConfig, build: Any, prompts: list[list[int]] | None,
                bos: int | None) -> dict[str, Any]:
    """The report of ``build``'s 8-bit KV cache against the engine dtype's pool (see the module docstring) on
    ``prompts`` (the calibration file's, read before the build started), or, when None, on text the model
    writes."""
    t0 = time.perf_counter()
    kv, ref = build.resolved_kv_cache_dtype, build.dtype
    block = build.tokens_per_block
    if prompts is not None:
        source = f"{Path(build.kv_calibration).name} ({len(prompts)} paragraphs)"
    else:
        prompts = own_text(module, model, ref, bos, max_prompt_len(build), block)
        source = f"the checkpoint's own text ({len(prompts)} sampled continuations, seed {SEED})"
    want = teacher_forced_logits(module, model, ref, prompts, block)
    got = teacher_forced_logits(module, model, kv, prompts, block)
    w, g = torch.cat(want), torch.cat(got)
    err = (g - w).abs()
    return {
        "kv_cache_dtype": kv,
        "reference_kv_cache_dtype": ref,
        "calibration": source,
        "prompts": len(prompts),
        "positions": int(w.shape[0]),
        "max_abs_logit_error": round(err.max().item(), 6),
        "mean_abs_logit_error": round(err.mean().item(), 6),
        "top1_agreement": round((g.argmax(-1) == w.argmax(-1)).float().mean().item(), 6),
        "seconds": round(time.perf_counter() - t0, 3),
    }
