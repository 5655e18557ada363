"""Shared helpers of the runtime tests: engines built once per process, HF greedy references cached.

Engines come from ``kiln.builder.build_engine`` (the real path: engine directory -> Engine.from_dir).
Transformers references: greedy ``generate(do_sample=False)`` of each prompt alone; the longest
generation per prompt is cached and shorter ones are its prefixes (greedy decoding is prefix-stable).
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from kiln.runtime import SamplingParams

_ENGINES: dict[tuple, object] = {}
_HF_MODELS: dict[str, object] = {}
_HF_CACHE: dict[tuple, list[int]] = {}

# small bounds so blocks, chunks and batches all get exercised on tiny models
TEST_BUILD = dict(max_batch_size=16, max_input_len=96, max_seq_len=128, max_num_tokens=128, tokens_per_block=8)


def get_engine(ckpt: Path, **build_overrides):
    """An Engine for ``ckpt`` built with TEST_BUILD (+ overrides); built once per process."""
    key = (str(ckpt), tuple(sorted(build_overrides.items())))
    if key not in _ENGINES:
        from kiln.builder import BuildConfig, build_engine
        from kiln.runtime.engine import Engine

        out = Path(tempfile.mkdtemp(prefix="kiln-rt-engine-"))
        atexit.register(shutil.rmtree, out, True)
        build_engine(ckpt, out, BuildConfig(**{**TEST_BUILD, **build_overrides}))
        _ENGINES[key] = Engine.from_dir(out)
    return _ENGINES[key]


def hf_greedy(ckpt: Path, prompt: list[int], max_new_tokens: int, eos_token_id: int = 2,
              ignore_eos: bool = False) -> list[int]:
    """Tokens transformers generates greedily for ``prompt`` alone (stops at EOS, like kiln, unless
    ``ignore_eos``: then it runs on past it, as kiln does with SamplingParams(ignore_eos=True))."""
    if ignore_eos:
        eos_token_id = 1 << 30   # no token has this id: nothing stops the generation
    key = (str(ckpt), tuple(prompt), ignore_eos)
    cached = _HF_CACHE.get(key)
    if cached is None or (len(cached) < max_new_tokens and (not cached or cached[-1] != eos_token_id)):
        from transformers import AutoModelForCausalLM

        model = _HF_MODELS.get(str(ckpt))
        if model is None:
            model = _HF_MODELS[str(ckpt)] = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        want = max(max_new_tokens, 24)
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=want, do_sample=False,
                                 eos_token_id=eos_token_id, pad_token_id=0, min_new_tokens=0)
        cached = _HF_CACHE[key] = out[0, len(prompt):].tolist()
    gen = cached[:max_new_tokens]
    if eos_token_id in gen:
        gen = gen[:gen.index(eos_token_id) + 1]
    return gen


def random_prompts(n: int, vocab: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def assert_no_leak(llm) -> None:
    """Every request ended and every KV block is back in the free pool, with the books balanced."""
    assert llm.executor.wait_idle(10)
    time.sleep(0.05)
    kv = llm.executor.kv
    kv.check_consistency()
    assert kv.num_used_blocks == 0, f"{kv.num_used_blocks} blocks still referenced after every request ended"
    assert kv.num_free_blocks == kv.num_blocks


# ---- one request through each of the LLM's entry points (the reliability and property tests) -------------
PROMPT = [5, 6, 7, 8]
ENTRY_POINTS = ("generate", "stream", "generate_async", "submit")


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run_via(llm, how: str, prompt, params, **kw):
    """The final output of one request through one of the LLM's entry points."""
    if how == "generate":   # a batch of one (a bare list of strings would be a batch of text prompts)
        return llm.generate([prompt], params, timeout=60, **kw)[0]
    if how == "stream":
        return list(llm.stream(prompt, params, **kw))[-1]
    if how == "generate_async":
        async def main():
            return [out async for out in llm.generate_async(prompt, params, **kw)][-1]

        return asyncio.run(main())
    q: queue.SimpleQueue = queue.SimpleQueue()
    llm.submit(prompt, params, callback=q.put, **kw)
    while not (out := q.get(timeout=60)).finished:
        pass
    return out


def still_serves(llm, ckpt) -> None:
    """The LLM returns transformers' greedy output and ends holding no KV block."""
    (out,) = llm.generate([PROMPT], GREEDY, timeout=60)
    assert out.token_ids == hf_greedy(ckpt, PROMPT, 6, ignore_eos=True)
    assert_no_leak(llm)
