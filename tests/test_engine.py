"""Engines end to end: build from a checkpoint, load with Engine.from_dir, compare with transformers.

Engines are built once per session (tiny checkpoints); the cpu-compiled (AOTInductor) build is
the slow one (~1 min) and runs once, in its own xdist group.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from kiln.builder import BuildConfig, build_engine
from kiln.contract import FORMAT_VERSION, EngineConfig, EngineLoadError, file_checksum, io_spec
from kiln.plugins.native import cpu_flags
from kiln.runtime import Engine

from paged_batch import PagedBatcher

FAMILIES = ["llama", "mistral", "qwen2", "gpt2"]
BUILD = BuildConfig(max_batch_size=4, max_input_len=96, max_seq_len=128, max_num_tokens=256,
                    tokens_per_block=4, gather_all_logits=True)
FP32_ATOL = 1e-4

pytestmark = pytest.mark.xdist_group("engines")

_engines: dict[tuple, Engine] = {}
_hf: dict[str, torch.nn.Module] = {}


@pytest.fixture(scope="session")
def engine_of(checkpoint_dir, tmp_path_factory):
    """engine_of(family, **build changes) -> Engine, built once per argument set."""

    def get(family: str, **changes) -> Engine:
        key = (family, tuple(sorted(changes.items())))
        if key not in _engines:
            out = tmp_path_factory.mktemp(f"engine-{family}") / "engine"
            build_engine(checkpoint_dir(family), out, BUILD.replace(**changes))
            _engines[key] = Engine.from_dir(out)
        return _engines[key]

    return get


def hf_logits(path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    if str(path) not in _hf:
        _hf[str(path)] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return _hf[str(path)](torch.tensor([tokens])).logits[0].float()


def new_batcher(engine: Engine, seed: int = 0) -> PagedBatcher:
    return PagedBatcher(engine.config.model, 64, engine.config.bounds.tokens_per_block, dtype=engine.kv_dtype,
                        seed=seed)


# (seq, new tokens) per step: packed prefills, then mixed steps (a late prefill, a 2nd chunk with a
# context offset, decodes), context entries first as the contract says.
SCHEDULE = [
    [("a", 13), ("b", 6)],
    [("c", 9), ("a", 1), ("b", 1)],
    [("b", 5), ("a", 1), ("c", 1)],
    [("a", 1), ("b", 1), ("c", 1)],
]


def run_schedule(engine: Engine, vocab: int, seed: int = 1, all_logits: bool = True):
    """Run SCHEDULE; returns the tokens of each sequence and {seq: {position: logits row}}."""
    rng = random.Random(seed)
    totals: dict[str, int] = {}
    for step in SCHEDULE:
        for s, n in step:
            totals[s] = totals.get(s, 0) + n
    tokens = {s: [rng.randrange(3, vocab) for _ in range(n)] for s, n in totals.items()}
    done = {s: 0 for s in totals}
    got: dict[str, dict[int, torch.Tensor]] = {s: {} for s in totals}
    batcher = new_batcher(engine)
    for step in SCHEDULE:
        batch = [(s, tokens[s][done[s] : done[s] + n]) for s, n in step]
        logits = engine.run(batcher.step(batch, all_logits=all_logits))
        assert logits.dtype == torch.float32 and logits.shape[1] == vocab
        row = 0
        for s, n in step:
            positions = range(done[s], done[s] + n) if all_logits else [done[s] + n - 1]
            for p in positions:
                got[s][p] = logits[row]
                row += 1
            done[s] += n
        assert row == logits.shape[0]
    return tokens, got


def max_error_vs_hf(engine: Engine, path) -> float:
    tokens, got = run_schedule(engine, engine.config.model.vocab_size)
    err = 0.0
    for s, toks in tokens.items():
        ref = hf_logits(path, toks)
        pos = sorted(got[s])
        assert ref.abs().max() > 1.0  # logits big enough for the comparison to mean something
        err = max(err, (torch.stack([got[s][p] for p in pos]) - ref[pos]).abs().max().item())
    return err


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_engine_matches_transformers(family, engine_of, checkpoint_dir):
    engine = engine_of(family)
    err = max_error_vs_hf(engine, checkpoint_dir(family))
    assert err <= FP32_ATOL, f"{family}: max abs logit error {err}"
    report = json.loads((engine.directory / "build_report.json").read_text())
    layers = engine.config.model.num_layers
    gemms = report["gemms"]
    # per layer: q/k/v -> 1 GEMM; gate/up -> 1 GEMM (gated MLP families)
    saved = 2 * layers + (layers if family != "gpt2" else 0)
    assert gemms["before_passes"] - gemms["after_passes"] == saved, gemms


def test_fp32_prefill_on_the_split_bf16_route_stays_near_transformers(engine_of, checkpoint_dir):
    """The split-bf16 route (KILN_FP32_MATMUL=high, AMX CPUs) on a prompt long enough for it: every logit row within
    5x the fp32 tolerance of transformers (its ~16 significant bits an operand: ~1e-4 on this model) while the
    default fp32 kernels stay within the tolerance itself."""
    from kiln.plugins import linear

    engine = engine_of("llama")
    vocab = engine.config.model.vocab_size
    rng = random.Random(11)
    tokens = [rng.randrange(3, vocab) for _ in range(120)]   # 30 of the batcher's 4-token blocks: within 32
    ref = hf_logits(checkpoint_dir("llama"), tokens)
    errors = {}
    routes = {"fp32 kernels": 0, "split": 64} if "amx_bf16" in cpu_flags() else {"fp32 kernels": 0}
    for route, m in routes.items():
        old = linear.set_fp32_gemm_m(m)
        try:
            logits = engine.run(new_batcher(engine).step([("a", tokens)], all_logits=True))
        finally:
            linear.set_fp32_gemm_m(old)
        errors[route] = (logits - ref).abs().max().item()
    print(f"max abs logit error against transformers, 120-token prefill: {errors}")
    assert errors["fp32 kernels"] <= FP32_ATOL and errors.get("split", 0.0) <= 5 * FP32_ATOL, errors


def test_kv_pool_reads_as_zeros_and_is_resident_only_where_written(engine_of):
    """The pool is fresh zero pages: 512 MiB of it costs no resident memory until blocks are written (the process's
    idle RSS), reads as zeros, and a step's writes land in it."""
    from kiln.runtime.zero_pages import zero_pages

    def anon_mib() -> float:
        with open("/proc/self/status") as f:
            return int(f.read().split("RssAnon:")[1].split()[0]) / 1024

    engine = engine_of("llama")
    per_block = engine.kv_bytes_per_token * engine.config.bounds.tokens_per_block
    before = anon_mib()
    kv = engine.allocate_kv_cache((512 << 20) // per_block)
    assert kv.is_contiguous() and kv.dtype == engine.kv_dtype and kv.data_ptr() % 4096 == 0
    assert anon_mib() - before < 64, "the pool was made resident at allocation"
    assert not kv[:, :, -3:].any()
    kv[:, :, -1].fill_(1.0)
    assert kv[:, :, -1].all() and not kv[:, :, -2].any()
    assert not zero_pages((0, 4), torch.float32).numel() and zero_pages((3, 4), torch.int8).sum() == 0


def test_engine_directory_contents(engine_of, checkpoint_dir):
    engine = engine_of("llama")
    d = engine.directory
    for name in ("config.json", "rank0.engine", "rank0.weights", "build_report.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (d / name).is_file(), name
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["format_version"] == FORMAT_VERSION and cfg["backend"] == "cpu"
    assert cfg["torch_version"] == torch.__version__ and cfg["kiln_version"]
    assert cfg["model"]["architecture"] == "LlamaForCausalLM"
    assert cfg["build"]["max_num_tokens"] == 256 and cfg["build"]["kv_cache_dtype"] == "float32"
    assert cfg["tokenizer"]["eos_token_ids"] == [2] and cfg["tokenizer"]["bos_token_id"] == 1
    # every file the runtime reads has the checksum of what was built
    assert set(cfg["checksums"]) == {"rank0.engine", "rank0.weights", *cfg["tokenizer"]["files"]} >= {"tokenizer.json"}
    assert all(file_checksum(d / name) == digest for name, digest in cfg["checksums"].items())
    # the build section reads back as the BuildConfig that rebuilds this engine; the bounds are resolved from it
    assert BuildConfig.from_dict(cfg["build"]) == BUILD.resolved()
    assert cfg["bounds"]["max_num_logits"] == 256 and cfg["bounds"]["max_blocks_per_seq"] == 32
    assert EngineConfig.from_dict(cfg) == engine.config
    io = io_spec(engine.config)
    names = [i["name"] for i in io["inputs"]]
    assert names == ["input_ids", "position_ids", "seq_lens", "context_lens", "block_tables", "slot_mapping",
                     "logits_indices", "kv_cache"]
    assert io["dims"]["num_tokens"] == [1, 256] and io["dims"]["max_blocks_per_seq"] == [1, 32]
    mem = cfg["memory"]
    m = cfg["model"]
    assert mem["kv_bytes_per_token"] == engine.kv_bytes_per_token == (
        2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 4)
    assert mem["kv_tokens_per_gib"] == (1 << 30) // mem["kv_bytes_per_token"]
    assert 0 < mem["activation_live_peak_bytes"] <= mem["activation_peak_bytes"] <= mem["activation_naive_bytes"]
    assert engine.weights_bytes == mem["weights_bytes"] > 0
    report = json.loads((d / "build_report.json").read_text())
    assert set(report["timings_s"]) >= {"load", "trace", "passes", "export", "memory_plan", "compile", "write", "total"}
    assert report["passes"]["merge_qkv"]["merged"] == m["num_layers"]
    # the runtime never needed the model definitions
    kv = engine.allocate_kv_cache(7)
    assert kv.shape == (m["num_layers"], 2, 7, 4, m["num_kv_heads"], m["head_dim"]) and kv.dtype == torch.float32


def test_engine_accepts_last_token_logits_and_rejects_missing_inputs(engine_of):
    engine = engine_of("llama")
    tokens, got = run_schedule(engine, engine.config.model.vocab_size, all_logits=False)
    _, full = run_schedule(engine, engine.config.model.vocab_size, all_logits=True)
    for s in got:
        for p, row in got[s].items():
            torch.testing.assert_close(row, full[s][p], atol=1e-5, rtol=1e-5)
    inputs = new_batcher(engine).step([("x", [5, 6, 7])])
    del inputs["slot_mapping"]
    with pytest.raises(ValueError, match="slot_mapping"):
        engine.run(inputs)


def test_engine_rejects_steps_beyond_its_bounds(engine_of):
    engine = engine_of("llama")
    b = new_batcher(engine)
    too_many = [(i, [3]) for i in range(engine.config.bounds.max_batch_size + 1)]
    with pytest.raises(ValueError, match=r"num_seqs \(seq_lens\) = 5 is outside this engine's range \[1, 4\]"):
        engine.run(b.step(too_many))
    ok = new_batcher(engine).step([("a", [3, 4, 5])])
    for name, change, message in [
        ("input_ids", lambda t: t.int(), "input_ids has dtype torch.int32"),
        ("kv_cache", lambda t: t.half(), "kv_cache is torch.float16"),
        ("kv_cache", lambda t: t[:, :, :, :2], "allocate_kv_cache"),
        ("position_ids", lambda t: t[:2], "position_ids has 2 rows, expected 3"),
        ("block_tables", lambda t: t.new_zeros(1, 33), r"blocks per sequence \(block_tables\) = 33"),
    ]:
        bad = dict(ok, **{name: change(ok[name])})
        with pytest.raises(ValueError, match=message):
            engine.run(bad)


def _agreement(engine_q: Engine, engine_ref: Engine, positions: int = 256,
               seqs: list[list[int]] | None = None) -> tuple[float, float, float]:
    """Top-1 agreement over ``positions`` packed prefill rows (``seqs``, default random tokens):
    (all rows, decided rows, share decided).

    "Decided" rows are those where the fp32 engine's top-2 logit margin is at least DECIDED_MARGIN.
    """
    vocab = engine_ref.config.model.vocab_size
    rng = random.Random(7)
    if seqs is None:
        seqs = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(positions // 64)]
    q, ref = (e.run(new_batcher(e).step([(i, s) for i, s in enumerate(seqs)], all_logits=True))
              for e in (engine_q, engine_ref))
    assert ref.shape[0] == positions
    same = q.argmax(-1) == ref.argmax(-1)
    top2 = ref.topk(2, -1).values
    decided = (top2[:, 0] - top2[:, 1]) >= DECIDED_MARGIN
    return same.float().mean().item(), same[decided].float().mean().item(), decided.float().mean().item()


# The tiny random checkpoints have ~unit-variance logits over 512 tokens: 1% of positions have a
# top-2 margin below 0.007, so ANY 0.5% weight perturbation (one int8 layer alone) flips about 1%
# of them. Agreement is asserted at >= 99% on positions whose margin is at least this value and
# reported on all of them.
DECIDED_MARGIN = 0.1


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_weight_only_int8_and_int4(family, engine_of):
    pytest.importorskip("kiln.plugins.linear")
    ref = engine_of(family)
    int8 = engine_of(family, quantization="int8_weight_only")
    int4 = engine_of(family, quantization="int4_weight_only", group_size=32)
    a8, d8, share = _agreement(int8, ref)
    a4, d4, _ = _agreement(int4, ref)
    print(f"\n{family}: top-1 agreement with fp32 over 256 positions (decided = margin >= {DECIDED_MARGIN}: "
          f"{share:.0%} of them): int8 {a8:.1%} / decided {d8:.1%}, {int8.weights_bytes} B weights; "
          f"int4 {a4:.1%} / decided {d4:.1%}, {int4.weights_bytes} B; fp32 {ref.weights_bytes} B")
    # the embedding table is int8 too (rows with their own scales): on the undecided near-ties of a random model
    # that is one more perturbation (94.9% overall measured for llama, 95.7% with an fp32 table)
    assert d8 >= 0.99 and a8 >= 0.94, (a8, d8)
    assert a4 >= 0.5, a4  # reported; int4 g32 on a tiny random model is coarse
    assert share >= 0.6
    # GPT-2's position table and the rope table stay in fp32
    assert int8.weights_bytes < 0.8 * ref.weights_bytes and int4.weights_bytes < int8.weights_bytes
    report = json.loads((int8.directory / "build_report.json").read_text())
    assert report["passes"]["weight_only_quant"]["quantized_gemms"] == report["gemms"]["after_passes"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_weight_only_int8_agrees_on_a_trained_checkpoint(family, checkpoint_dir, tmp_path):
    """The >= 99% int8 agreement check on checkpoints whose predictions mean something: the tiny
    model fitted to the synthetic corpus for 100 AdamW steps (next-token accuracy on that text: llama 98%,
    gpt2 84%; not memorised to certainty), evaluated on 256 positions of the text."""
    from tokenizers import Tokenizer

    from synthetic_checkpoints import corpus_token_ids

    ckpt = checkpoint_dir(family, train_steps=100)
    ref, int8, int4 = (Engine.from_dir(build_engine(ckpt, tmp_path / q, BUILD.replace(quantization=q, group_size=32)))
                       for q in ("none", "int8_weight_only", "int4_weight_only"))
    ids = corpus_token_ids(Tokenizer.from_file(str(ckpt / "tokenizer.json")))
    seqs = [ids[o : o + 64] for o in range(0, 4 * 97, 97)]  # 4 windows of 64 tokens, 256 positions
    logits = ref.run(new_batcher(ref).step([(i, s) for i, s in enumerate(seqs)], all_logits=True))
    nxt = torch.tensor([ids[o + j + 1] for o in range(0, 4 * 97, 97) for j in range(64)])
    learned = (logits.argmax(-1) == nxt).float().mean().item()
    a8, d8, share = _agreement(int8, ref, seqs=seqs)
    a4, _, _ = _agreement(int4, ref, seqs=seqs)
    print(f"\n{family} trained on the corpus (next-token accuracy {learned:.1%}, {share:.0%} of positions with a "
          f"top-2 margin >= {DECIDED_MARGIN}): top-1 agreement with fp32 over 256 positions: int8 {a8:.1%}, "
          f"int4 g32 {a4:.1%}")
    assert learned >= 0.8, learned  # the checkpoint did learn the text
    assert a8 >= 0.99, a8
    assert a4 >= 0.85, a4  # reported; int4 g32 is coarse


def test_bf16_engine(engine_of, checkpoint_dir):
    ref = engine_of("qwen2")
    eng = engine_of("qwen2", dtype="bfloat16")
    assert eng.kv_dtype == torch.bfloat16 and eng.weights_bytes < 0.65 * ref.weights_bytes  # the fp32 rope table stays
    _, got = run_schedule(eng, eng.config.model.vocab_size)
    _, want = run_schedule(ref, ref.config.model.vocab_size)
    scale = max(r.abs().max().item() for s in want for r in want[s].values())
    err = max((got[s][p] - want[s][p]).abs().max().item() for s in want for p in want[s])
    assert err <= 0.05 * scale, (err, scale)


# ------------------------------------------------------------------------------ load errors
@pytest.fixture
def engine_copy(engine_of, tmp_path):
    src = engine_of("gpt2").directory
    dst = tmp_path / "engine"
    shutil.copytree(src, dst)
    return dst


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_load_errors_missing(tmp_path, engine_copy):
    with pytest.raises(EngineLoadError, match="not an engine directory"):
        Engine.from_dir(tmp_path / "nowhere")
    (engine_copy / "rank0.weights").unlink()
    with pytest.raises(EngineLoadError, match=r"rank0\.weights: missing"):
        Engine.from_dir(engine_copy)
    (engine_copy / "rank0.engine").unlink()
    with pytest.raises(EngineLoadError, match=r"rank0\.engine: missing"):
        Engine.from_dir(engine_copy)
    (engine_copy / "config.json").unlink()
    with pytest.raises(EngineLoadError, match=r"config\.json: missing"):
        Engine.from_dir(engine_copy)


def test_load_errors_incompatible(engine_copy):
    _edit_config(engine_copy, format_version=99)
    with pytest.raises(EngineLoadError, match=r"format version 99.*rebuild"):
        Engine.from_dir(engine_copy)
    _edit_config(engine_copy, format_version=FORMAT_VERSION, torch_version="2.1.0")
    with pytest.raises(EngineLoadError, match=r"torch 2\.1\.0.*cannot be loaded by torch"):
        Engine.from_dir(engine_copy)
    _edit_config(engine_copy, torch_version=torch.__version__, backend="tensorrt")
    with pytest.raises(EngineLoadError, match="backend 'tensorrt'"):
        Engine.from_dir(engine_copy)
    (engine_copy / "config.json").write_text("{not json")
    with pytest.raises(EngineLoadError, match="not valid JSON"):
        Engine.from_dir(engine_copy)
    (engine_copy / "config.json").write_text(json.dumps({"format_version": FORMAT_VERSION}))
    with pytest.raises(EngineLoadError, match="'torch_version' is missing"):
        Engine.from_dir(engine_copy)


def test_load_errors_corrupt(engine_copy):
    """Damage is caught by the checksum first; without it (verify=False) by the loader's own checks."""
    path = engine_copy / "rank0.engine"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(EngineLoadError, match=r"rank0\.engine: checksum mismatch"):
        Engine.from_dir(engine_copy)
    with pytest.raises(EngineLoadError, match=r"corrupt engine file \(not a \.pt2 archive\)"):
        Engine.from_dir(engine_copy, verify=False)
    path.write_bytes(b"this is not an engine" * 100)
    with pytest.raises(EngineLoadError, match=r"corrupt engine file \(not a \.pt2 archive\)"):
        Engine.from_dir(engine_copy, verify=False)
    # a valid zip whose contents are damaged
    import zipfile

    from kiln.contract import read_engine_config, stamp_rank_file

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"garbage")
    with pytest.raises(EngineLoadError, match=r"rank0\.engine: carries no readable rank stamp"):
        Engine.from_dir(engine_copy, verify=False)
    stamp_rank_file(path, 0, read_engine_config(engine_copy).tensor_parallel)   # this build's rank 0, in name only
    with pytest.raises(EngineLoadError, match="the file is corrupt or truncated, rebuild it"):
        Engine.from_dir(engine_copy, verify=False)


def test_load_errors_weights(engine_copy):
    """The weights file: truncated, not a weights file, or missing a tensor the graph reads (the checksum
    refuses each first; these are the loader's own errors behind it)."""
    from kiln.contract import load_weights, save_weights

    path = engine_copy / "rank0.weights"
    weights = {k: v.clone() for k, v in load_weights(path).items()}
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineLoadError, match=r"rank0\.weights: checksum mismatch"):
        Engine.from_dir(engine_copy)
    with pytest.raises(EngineLoadError, match=r"rank0\.weights: not a readable weights file.*rebuild"):
        Engine.from_dir(engine_copy, verify=False)
    torch.save([1, 2, 3], path)
    with pytest.raises(EngineLoadError, match="not a kiln weights file"):
        Engine.from_dir(engine_copy, verify=False)
    dropped = sorted(weights)[0]
    save_weights({k: v for k, v in weights.items() if k != dropped}, path)
    with pytest.raises(EngineLoadError, match=rf"no tensor for \['{dropped}'\].*do not belong together"):
        Engine.from_dir(engine_copy, verify=False)


# ------------------------------------------------------------------------------ cpu-compiled
def test_a_package_compiled_for_avx512_is_refused_on_a_cpu_without_it(monkeypatch, tmp_path):
    """An AOTInductor package built on an AVX-512 machine would die of SIGILL on an AVX2-only one: named."""
    from kiln.runtime import aoti_runner

    monkeypatch.setattr(aoti_runner, "cpu_capability", lambda: "AVX2")
    with pytest.raises(EngineLoadError, match=r"compiled for AVX512 AVX512_VNNI .*this CPU has AVX2; rebuild the "
                                              r"engine on this machine"):
        aoti_runner.check_package_isa("AVX512 AVX512_VNNI", tmp_path / "rank0.engine")
    aoti_runner.check_package_isa("AVX2", tmp_path / "rank0.engine")
    monkeypatch.setattr(aoti_runner, "cpu_capability", lambda: "AVX512")
    aoti_runner.check_package_isa("AVX512 AVX512_VNNI", tmp_path / "rank0.engine")


@pytest.mark.slow
@pytest.mark.xdist_group("aoti")
def test_cpu_compiled_engine_matches_transformers(checkpoint_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine-aoti") / "engine"
    build_engine(checkpoint_dir("llama"), out, BUILD.replace(backend="cpu-compiled"))
    engine = Engine.from_dir(out)
    assert engine.backend == "cpu-compiled"
    err = max_error_vs_hf(engine, checkpoint_dir("llama"))
    assert err <= FP32_ATOL, err
    _check_c_shims(out)
    # the KV pool is written in place by the compiled package
    b = new_batcher(engine)
    inputs = b.step([("x", [5, 6, 7, 8, 9])])
    engine.run(inputs)
    assert inputs["kv_cache"].abs().sum() > 0
    # the package holds no weights: they come from rank0.weights, and one missing is named
    from kiln.contract import load_weights, save_weights

    weights = {k: v.clone() for k, v in load_weights(out / "rank0.weights").items()}
    save_weights({k: v for k, v in weights.items() if k != "norm.weight"}, out / "rank0.weights")
    with pytest.raises(EngineLoadError, match=r"no tensor for \['norm\.weight'\].*do not belong together"):
        Engine.from_dir(out, verify=False)
    save_weights(weights, out / "rank0.weights")
    cfg = json.loads((out / "config.json").read_text())
    major_minor = ".".join(torch.__version__.split(".")[:2])
    _edit_config(out, torch_version=major_minor + ".99")  # a compiled package needs the exact torch release
    with pytest.raises(EngineLoadError, match="cannot be loaded by torch"):
        Engine.from_dir(out)
    assert cfg["backend"] == "cpu-compiled"


def _check_c_shims(out) -> None:
    """The compiled graph calls the linears and attention through the native library's C shims (no proxy executor
    call is left in a llama graph); the engine still runs with the native kernels disabled (the shims' kernels then
    run the ops' Python implementations), and where the library cannot load, loading it says so."""
    import subprocess
    import sys
    import zipfile

    from kiln.plugins import aoti_shims

    with zipfile.ZipFile(out / "rank0.engine") as z:
        src = next(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))
    for op in ("fp32_linear", "paged_attention"):
        assert f"{aoti_shims.symbol(op)}(" in src, op
    assert "proxy_executor_call_function(" not in src
    report = json.loads((out / "build_report.json").read_text())
    assert report["backend"]["c_shims"] == sorted(f"kiln::{op}" for op in aoti_shims.SHIMS)
    run = ("from kiln.contract import SeqChunk, pack_inputs; from kiln.runtime import Engine; "
           f"e = Engine.from_dir({str(out)!r}); kv = e.allocate_kv_cache(4); "
           "inputs = pack_inputs([SeqChunk([5, 6, 7], 0, [0, 1, 2, 3], 1)], kv, e.config.bounds.tokens_per_block); "
           "print(e.run(inputs).argmax(dim=1).tolist())")
    env = dict(os.environ)
    on = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, env=env, timeout=300)
    off = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=300,
                         env={**env, "KILN_DISABLE_NATIVE_KERNELS": "1"})
    assert on.returncode == 0 and off.returncode == 0, (on.stderr[-2000:], off.stderr[-2000:])
    assert on.stdout.split()[-1] == off.stdout.split()[-1]
    unavailable = "import kiln.plugins.native as n; n._state = 'failed'; " + run
    res = subprocess.run([sys.executable, "-c", unavailable], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode != 0 and "calls kiln's native kernels directly" in res.stderr, res.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.xdist_group("aoti")
def test_cpu_compiled_bf16_linears_with_bias_match_the_cpu_engine(checkpoint_dir, tmp_path_factory):
    """Qwen2's q/k/v projections have biases: through bf16_linear's C shim (an optional tensor passed by pointer)
    the compiled engine gives the cpu engine's logits."""
    root = tmp_path_factory.mktemp("engine-aoti-bias")
    build = BUILD.replace(dtype="bfloat16")
    cpu = Engine.from_dir(build_engine(checkpoint_dir("qwen2"), root / "cpu", build))
    want = run_schedule(cpu, cpu.config.model.vocab_size)[1]
    compiled = build_engine(checkpoint_dir("qwen2"), root / "compiled", build.replace(backend="cpu-compiled"))
    got = run_schedule(Engine.from_dir(compiled), cpu.config.model.vocab_size)[1]
    for s in want:
        for p in want[s]:
            torch.testing.assert_close(got[s][p], want[s][p], rtol=0, atol=0.02 * want[s][p].abs().max().item())


@pytest.mark.slow
@pytest.mark.xdist_group("aoti")
def test_cpu_compiled_tied_lm_head_matches_transformers(checkpoint_dir, tmp_path_factory):
    """gpt2 ties its LM head to the token table: compiled, the table is stored once in panels (the LM head's layout)
    and the lookup gathers its rows from them, with transformers' logits."""
    out = tmp_path_factory.mktemp("engine-aoti-tied") / "engine"
    build_engine(checkpoint_dir("gpt2"), out, BUILD.replace(backend="cpu-compiled"))
    engine = Engine.from_dir(out)
    assert max_error_vs_hf(engine, checkpoint_dir("gpt2")) <= FP32_ATOL
    report = json.loads((out / "build_report.json").read_text())
    assert report["passes"]["fast_linear"]["tied_lookups"] == 1
    from kiln.contract import load_weights

    names = set(load_weights(out / "rank0.weights"))
    assert "lm_head_packed" in names and not any(n.startswith("embed_tokens") for n in names)


def test_a_step_without_logits(engine_of):
    """A step of only non-final prefill chunks asks for no logits (chunked prefill)."""
    engine = engine_of("llama")
    b = new_batcher(engine)
    inputs = b.step([("a", [3, 4, 5, 6])])
    inputs["logits_indices"] = inputs["logits_indices"][:0]
    out = engine.run(inputs)
    assert out.shape == (0, engine.config.model.vocab_size)
    assert inputs["kv_cache"].abs().sum() > 0  # the chunk's keys/values were written
