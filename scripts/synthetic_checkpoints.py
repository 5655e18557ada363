"""Small random-weight Hugging Face checkpoints for demos, tests and benchmarks.

There is no model hub on the machines kiln is developed on, so checkpoints are made
locally with ``transformers`` (``*Config`` + ``save_pretrained``) and a byte-level BPE
tokenizer trained with ``tokenizers`` on a short built-in text. The loading code that
reads them is the real one. ``transformers`` is only needed here, not by kiln itself.

This is scaffolding for the demo, the benchmarks and the tests, not part of the installed package: it
lives in scripts/ (the demo and benchmarks run from there, so it is on their import path) and the tests
add scripts/ to theirs (pytest's ``pythonpath`` in pyproject.toml).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# Sizes: "tiny" for tests, "small" for the demo ("small-draft": its draft), "300m" for benchmarks (~300-500M params),
# "246m" the same architecture with 16 layers: the size of the checkpoint the peers' decode speeds in
# ../shared/notes were measured on (llama.cpp, onnxruntime-genai); "246m-moe*" its MoE twins (scripts/bench_moe.py).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=512),
    "small": dict(hidden=256, inter=688, layers=4, heads=8, kv_heads=4, vocab=2048),
    # a draft for "small" (speculative decoding, scripts/bench_speculative.py): its vocabulary, ~4.4x fewer parameters
    "small-draft": dict(hidden=128, inter=344, layers=2, heads=4, kv_heads=2, vocab=2048),
    "300m": dict(hidden=1024, inter=2816, layers=22, heads=16, kv_heads=4, vocab=32000),
    "246m": dict(hidden=1024, inter=2816, layers=16, heads=16, kv_heads=4, vocab=32000),
    # MoE models with the 246m's attention and its active MLP width per token (top_k x expert width = 2816):
    # Mixtral-style 8 experts, top 2; Qwen3-MoE-style 16 experts, top 4 (~660M parameters each, ~246M active)
    "246m-moe8": dict(hidden=1024, inter=2816, layers=16, heads=16, kv_heads=4, vocab=32000, experts=8, top_k=2,
                      expert_inter=1408),
    "246m-moe16": dict(hidden=1024, inter=2816, layers=16, heads=16, kv_heads=4, vocab=32000, experts=16, top_k=4,
                       expert_inter=704),
}

# Families whose random checkpoints get norm weights away from their init (ones, or Gemma's zeros under 1 + w),
# so that a norm applied wrongly (or not at all) changes the logits; the older families keep their checkpoints.
NORM_JITTER = {"qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"}

CORPUS = """\
The kiln fires the clay slowly, and the potter waits by the door. A request arrives, then another;
the scheduler packs them into one step so that nobody waits for the longest answer.
Tokens flow through the engine: prefill reads the prompt, decode writes one token at a time.
Memory is the wall: every token keeps its keys and values in the cache, block by block.
Héllo wörld — naïve café, São Paulo, Zürich, 東京, 北京, Ελληνικά, русский, 🙂🚀✨.
def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i * i)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828.
"""


# The test and demo checkpoints' chat template (Zephyr-style turns; </s> ends each turn), so that chat
# endpoints work on them as on a real instruction-tuned checkpoint.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def hf_config(family: str, size: str = "tiny", **overrides: Any):
    """A transformers config object for ``family`` at a preset size: llama, mistral, qwen2, gpt2, qwen3,
    gemma2, gemma3 (text), phi3, mixtral, qwen3_moe. The MoE families get ``experts`` experts (preset
    ``experts``/``top_k``/``expert_inter``, or 8 experts, top 2, half the dense width)."""
    import transformers

    p = PRESETS[size]
    if family == "gpt2":
        args = dict(n_embd=p["hidden"], n_inner=p["inter"], n_layer=p["layers"], n_head=p["heads"],
                    vocab_size=p["vocab"], n_positions=1024, bos_token_id=1, eos_token_id=2)
        args.update(overrides)
        return transformers.GPT2Config(**args)
    args = dict(hidden_size=p["hidden"], intermediate_size=p["inter"], num_hidden_layers=p["layers"],
                num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"], vocab_size=p["vocab"],
                max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    head_dim = p["hidden"] // p["heads"]
    experts = dict(experts=p.get("experts", 8), top_k=p.get("top_k", 2), inter=p.get("expert_inter", p["inter"] // 2))
    args.update({
        "qwen3": dict(head_dim=head_dim),
        "gemma2": dict(head_dim=head_dim, query_pre_attn_scalar=head_dim),
        "gemma3": dict(head_dim=head_dim, query_pre_attn_scalar=head_dim),
        "mixtral": dict(num_local_experts=experts["experts"], num_experts_per_tok=experts["top_k"],
                        intermediate_size=experts["inter"]),
        "qwen3_moe": dict(head_dim=head_dim, num_experts=experts["experts"], num_experts_per_tok=experts["top_k"],
                          moe_intermediate_size=experts["inter"]),
    }.get(family, {}))
    args.update(overrides)
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
               "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "phi3": "Phi3Config",
               "mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig"}
    return getattr(transformers, classes[family])(**args)


def _pseudo_words(count: int, seed: int = 0) -> list[str]:
    """Deterministic made-up words, so BPE has enough material to learn a vocabulary of any size."""
    import random

    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
              "st", "tr", "ch", "sh"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "é", "ö"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "ck", "ng"]
    return ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 4)))
            for _ in range(count)]


TOKENIZER_KINDS = ("bpe", "sentencepiece")


def train_tokenizer(vocab_size: int, kind: str = "bpe"):
    """A tokenizer with <unk>, <s>, </s> as ids 0, 1, 2, trained on :data:`CORPUS` and made-up words.

    ``bpe``: byte-level BPE (GPT-2, Llama 3, Qwen): every byte is a token character (``Ġ`` for a space).
    ``sentencepiece``: the layout Hugging Face converts SentencePiece models to (Llama 2, Mistral, Gemma):
    words start with ``▁``, characters outside the learned alphabet fall back to ``<0xXX>`` byte tokens
    (ids 3-258), and decoding strips the space the first word was given.
    """
    if kind == "bpe":
        return _train_byte_level_bpe(vocab_size)
    if kind == "sentencepiece":
        return _train_sentencepiece_style(vocab_size)
    raise ValueError(f"tokenizer kind must be one of {TOKENIZER_KINDS}, got {kind!r}")


def _training_text(vocab_size: int) -> list[str]:
    """The corpus, and enough made-up words for BPE to learn a vocabulary of ``vocab_size``."""
    words = _pseudo_words(max(2000, vocab_size))
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    return [CORPUS] * 4 + lines * 2


def _train_byte_level_bpe(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_training_text(vocab_size), trainer=trainer)
    return tok


def _train_sentencepiece_style(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials, num_bytes = ["<unk>", "<s>", "</s>"], 256
    if vocab_size < len(specials) + num_bytes + 64:
        raise ValueError(f"a sentencepiece-style vocabulary needs at least {len(specials) + num_bytes + 64} "
                         f"tokens (specials, 256 byte tokens, some pieces), got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    # the alphabet is printable ASCII (and little else), so that other characters (CJK, emoji) are spelled
    # with byte tokens
    ascii_printable = [chr(c) for c in range(0x21, 0x7F)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - num_bytes, special_tokens=specials,
                                  initial_alphabet=ascii_printable, limit_alphabet=len(ascii_printable) + 8,
                                  show_progress=False)
    tok.train_from_iterator(_training_text(vocab_size), trainer=trainer)
    spec = json.loads(tok.to_str())
    learned = sorted(((i, t) for t, i in spec["model"]["vocab"].items() if i >= len(specials)))
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(num_bytes)})
    vocab.update({t: len(vocab) + k for k, (_, t) in enumerate(learned)})
    spec["model"]["vocab"] = vocab
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def make_checkpoint(
    out_dir: str | Path,
    family: str = "llama",
    size: str = "tiny",
    *,
    seed: int = 0,
    shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    train_steps: int = 0,
    train_seq_len: int = 64,
    tokenizer: str = "bpe",
    **overrides: Any,
) -> Path:
    """Write config.json, safetensors weights (sharded if ``shard_size``) and tokenizer files
    (``tokenizer``: one of :data:`TOKENIZER_KINDS`, see :func:`train_tokenizer`).

    ``train_steps`` > 0 fits the random model to :data:`CORPUS` first (see :func:`train_on_corpus`),
    for checks that need a model whose predictions are not near-ties; it predicts the text at the positions it
    was fitted on (``train_seq_len``), not much past them.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(family, size, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if train_steps else dtype)
    with torch.no_grad():  # larger-than-default init so random models make confident, varied predictions
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "norm" not in name and "ln" not in name:
                param.normal_(0.0, 1.0 / max(param.shape[-1], 1) ** 0.5)
            elif "norm" in name and family in NORM_JITTER:   # norms a test must see (Gemma's 1 + w, q/k norms)
                param.add_(torch.empty_like(param).uniform_(-0.3, 0.3))
    tok = train_tokenizer(config.vocab_size, tokenizer)
    if train_steps:
        train_on_corpus(model, corpus_token_ids(tok), train_steps, seed=seed, seq_len=train_seq_len)
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out, **kwargs)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    return out


def corpus_token_ids(tok) -> list[int]:
    """:data:`CORPUS` (four times over) as token ids of ``tok``: the text a trained checkpoint has seen."""
    return tok.encode(CORPUS * 4).ids


def corpus_period(tok) -> int:
    """Tokens of one :data:`CORPUS` (the stream of :func:`corpus_token_ids` repeats it)."""
    return len(tok.encode(CORPUS).ids)


def train_on_corpus(model, ids: list[int], steps: int, *, seed: int = 0, seq_len: int = 64, batch: int = 8,
                    lr: float = 3e-3) -> float:
    """Fit ``model`` (a transformers causal LM, fp32) to the token stream ``ids`` for ``steps`` AdamW
    steps on random windows; returns the last loss.

    A random model's top-2 logits are nearly tied at about 1% of positions, so any check of "does
    this engine predict the same token" on it partly measures noise; a few hundred steps on the
    corpus make a tiny model predict that text confidently, as a trained model does its domain.
    """
    data = torch.tensor(ids)
    if len(data) < seq_len + 1:
        raise ValueError(f"the corpus has {len(data)} tokens, fewer than a training window ({seq_len + 1})")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())
