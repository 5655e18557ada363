"""The byte bound on prompts (kiln.serving.prompt_bounds) against real `tokenizers` pipelines: where kiln gives
a bound, no text has fewer tokens than its bytes / the bound (hypothesis, over text with multi-byte, combining
and compatibility characters); where a pipeline can drop or shrink text, kiln gives none (and the tokenizer is
shown to do it). Then the prompt workers: small jobs inline, large ones in a thread, Busy past the queue."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kiln.serving.prompt_bounds import PromptBounds, max_bytes_per_token, tokenize
from kiln.serving.prompt_workers import Busy, PromptWorkers

from synthetic_checkpoints import CORPUS, train_tokenizer

TEXTS = [CORPUS, "𝐀𝐁𝐂 ＡＢＣ ① ﬁ e\u0301 \u1100\u1161\u11a8 İ\u212a " * 3, "   \n\t  x" * 20]


def byte_level() -> Tokenizer:
    return train_tokenizer(512)   # the test checkpoints' tokenizer (GPT-2 style)


def sentencepiece_like() -> Tokenizer:
    """Llama-2 / Mistral style: BPE with byte fallback over "▁"-joined text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator([CORPUS] * 8, trainer=trainers.BpeTrainer(vocab_size=600, special_tokens=special,
                                                                       show_progress=False))
    return tok


def qwen_like() -> Tokenizer:
    """Qwen2 style: NFC, then a digit split, then byte level."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=r"\d", behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.train_from_iterator([CORPUS] * 8, trainer=trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


def nfkc_lowercase(base: Tokenizer) -> Tokenizer:
    tok = Tokenizer.from_str(base.to_str())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    return tok


TOKENIZERS = {"byte-level": byte_level, "sentencepiece-like": sentencepiece_like, "qwen-like": qwen_like,
              "nfkc-lowercase": lambda: nfkc_lowercase(byte_level())}
_made: dict[str, Tokenizer] = {}


def get(name: str) -> Tokenizer:
    if name not in _made:
        _made[name] = TOKENIZERS[name]()
    return _made[name]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_bound_holds_on_text_that_shrinks(name):
    tok = get(name)
    per_token = max_bytes_per_token(tok)
    assert per_token is not None and per_token >= 4
    for text in TEXTS:
        ids = tokenize(tok, text, add_special_tokens=False)
        assert ids == tok.encode(text, add_special_tokens=False).ids   # the faster call, the same tokens
        assert len(text.encode()) <= len(ids) * per_token, (name, text[:40])
    if name == "nfkc-lowercase":   # NFKC makes "𝐚" (4 bytes) "a": without the factor 4 the bound would fail
        word = max((t for t in (tok.decode([i]) for i in range(tok.get_vocab_size())) if t.isascii() and t.isalpha()),
                   key=len)
        bold = "".join(chr(0x1D41A + ord(c.lower()) - ord("a")) for c in word)
        ids = tokenize(tok, bold, add_special_tokens=False)
        assert len(bold.encode()) > len(ids) * per_token // 4, (word, len(ids))


@settings(max_examples=150, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), min_size=1, max_size=200),
       name=st.sampled_from(sorted(TOKENIZERS)))
def test_no_text_has_fewer_tokens_than_its_bytes_over_the_bound(text, name):
    tok = get(name)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(text.encode()) <= len(ids) * max_bytes_per_token(tok)


def test_pipelines_that_drop_or_shrink_text_get_no_bound():
    base = byte_level()

    def variant(**parts) -> Tokenizer:
        tok = Tokenizer.from_str(base.to_str())
        for attr, value in parts.items():
            setattr(tok, attr, value)
        return tok

    whitespace = variant(pre_tokenizer=pre_tokenizers.Whitespace())
    assert whitespace.encode(" " * 1000).ids == []   # 1000 bytes, no token: no byte bound can hold
    assert max_bytes_per_token(whitespace) is None
    for tok in (variant(normalizer=normalizers.Strip()), variant(normalizer=normalizers.StripAccents()),
                variant(normalizer=normalizers.Replace("x", "")),
                variant(normalizer=normalizers.BertNormalizer()),
                variant(pre_tokenizer=pre_tokenizers.Split(pattern=" ", behavior="removed")),
                variant(pre_tokenizer=pre_tokenizers.WhitespaceSplit())):
        assert max_bytes_per_token(tok) is None, tok.to_str()[:200]
    truncating = Tokenizer.from_str(base.to_str())
    truncating.enable_truncation(8)
    assert max_bytes_per_token(truncating) is None
    assert max_bytes_per_token(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))) is None
    # BPE without an unknown token, byte fallback or a byte-level alphabet drops what it does not know
    plain = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    assert plain.encode("a€b").ids == [0, 1]
    assert max_bytes_per_token(plain) is None


def test_prompt_bounds_messages():
    bounds = PromptBounds.of(byte_level(), 96)
    assert bounds.max_text_bytes == 96 * max_bytes_per_token(byte_level())
    assert bounds.text_problem("x" * bounds.max_text_bytes) is None
    assert "at least" in bounds.text_problem("x" * (bounds.max_text_bytes + 1))
    over = "é" * (bounds.max_text_bytes // 2 + 1)   # fewer characters than the bound, more bytes
    message = bounds.text_problem(over)
    assert f"is {len(over.encode())} bytes" in message and "max_input_len (96 tokens)" in message
    assert bounds.ids_problem(96) is None and "97 tokens" in bounds.ids_problem(97)
    assert PromptBounds.of(None, 96).text_problem("x" * 10**6) is None   # no tokenizer: no byte bound


def test_prompt_workers_inline_pooled_and_busy():
    workers = PromptWorkers(1, max_pending_bytes=25, inline_bytes=10)
    release = threading.Event()
    here = threading.get_ident()

    async def main():
        assert await workers.run(threading.get_ident, size=9) == here      # small: in the caller's thread
        assert await workers.run(threading.get_ident, size=10) != here     # large: in a worker
        blocker = workers.submit(release.wait, size=10)
        queued = workers.submit(lambda: 7, size=15)
        with pytest.raises(Busy):   # 10 + 15 bytes of input already pending: no more
            workers.submit(lambda: 8, size=10)
        assert workers.jobs == 2
        release.set()
        assert blocker.result(10) and queued.result(10) == 7
        with pytest.raises(ValueError, match="boom"):   # errors come back to the caller
            await workers.run(lambda: (_ for _ in ()).throw(ValueError("boom")), size=10)

    try:
        asyncio.run(main())
        assert workers.jobs == 0
        assert workers.submit(lambda: 1, size=1000).result(10) == 1   # one job is always taken
        gate = threading.Event()
        workers.submit(gate.wait, size=10)
        cancelled = workers.submit(lambda: 9, size=10)
        assert cancelled.cancel() and workers.jobs == 1   # a job cancelled before it ran frees its place
        workers.submit(lambda: 10, size=15).cancel()
        gate.set()
    finally:
        workers.shutdown()


# ---- the count of JSON values a large body is refused by before it is parsed (kiln.serving.json_values) ----
json_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                        st.text(alphabet=st.sampled_from('ab,[{"\\\\ é\n'), max_size=12))
json_docs = st.recursive(json_leaves, lambda kids: st.one_of(
    st.lists(kids, max_size=6), st.dictionaries(st.text(alphabet=st.sampled_from('k,"\\\\[{'), max_size=4), kids,
                                                max_size=5)), max_leaves=40)


def elements(value) -> int:
    """The count from the parsed document: each container's elements, an empty container counting one."""
    if isinstance(value, list):
        return max(len(value), 1) + sum(elements(v) for v in value)
    if isinstance(value, dict):
        return max(len(value), 1) + sum(elements(v) for v in value.values())
    return 0


@settings(max_examples=300, deadline=None)
@given(doc=json_docs, slice_bytes=st.integers(1, 9), indent=st.sampled_from([None, 1]))
def test_json_values_are_counted_as_the_parsed_document_has_them(doc, slice_bytes, indent):

    from kiln.serving.json_values import count_json_values

    data = json.dumps(doc, indent=indent, ensure_ascii=False).encode()
    assert count_json_values(data, slice_bytes) == elements(json.loads(data)), data


def test_json_values_of_escapes_across_slices():
    from kiln.serving.json_values import count_json_values

    # a run of backslashes that ends a slice: even runs do not escape the quote after them, odd ones do
    for run in range(6):
        text = "\\" * run + '"'
        data = json.dumps([text, 1, 2]).encode()
        for slice_bytes in range(1, len(data) + 1):
            assert count_json_values(data, slice_bytes) == 3, (data, slice_bytes)
    assert count_json_values(b"") == 0
    assert count_json_values(b'"[,{"') == 0
    assert count_json_values(b"[" + b"5," * 99_999 + b"5]") == 100_000
