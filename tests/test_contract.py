"""kiln.contract on its own: no other kiln package behind it, the packer, the typed config.json and its errors."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from kiln.contract import (
    FORMAT_VERSION,
    BuildConfigError,
    EngineBounds,
    EngineConfig,
    EngineInputError,
    EngineLoadError,
    MemorySummary,
    ModelConfig,
    SeqChunk,
    TensorParallelMapping,
    TokenizerInfo,
    check_inputs,
    check_rank_file,
    format_table,
    io_spec,
    kv_bytes_per_token,
    kv_cache_shape,
    kv_row_size,
    pack_inputs,
    read_engine_config,
    stamp_rank_file,
    summary_rows,
)

SHA = "sha256:" + "ab" * 32
MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=192,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                    rope_scaling={"rope_type": "linear", "factor": 2.0})


def make_config(**changes) -> EngineConfig:
    base = dict(
        format_version=FORMAT_VERSION, torch_version=torch.__version__, kiln_version="0.1.0", backend="cpu",
        dtype="float32", kv_cache_dtype="bfloat16", quantization="none", model=MODEL,
        bounds=EngineBounds(max_batch_size=4, max_num_tokens=64, max_input_len=48, max_seq_len=64,
                            tokens_per_block=8, max_num_logits=4, max_blocks_per_seq=8),
        memory=MemorySummary(weights_bytes=1000, activation_peak_bytes=300, activation_live_peak_bytes=200,
                             activation_naive_bytes=900, num_buffers=12, kv_bytes_per_token=256,
                             kv_tokens_per_gib=(1 << 30) // 256),
        tokenizer=TokenizerInfo(files=["tokenizer.json"], eos_token_ids=[2], bos_token_id=1),
        engine_files=["rank0.engine"], tensor_parallel=TensorParallelMapping.plan(MODEL, 1, build_id="b0"),
        checksums={"rank0.engine": "sha256:" + "0" * 64, "rank0.weights": SHA, "tokenizer.json": SHA},
        build={"dtype": "float32", "max_batch_size": 4},
    )
    return EngineConfig(**{**base, **changes})


def test_contract_imports_no_other_kiln_package():
    code = "import sys, kiln.contract; print(sorted(m for m in sys.modules if m.startswith('kiln')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    mods = eval(out)  # noqa: S307 - our own subprocess' repr of a list of str
    assert mods and all(m == "kiln" or m.startswith("kiln.contract") for m in mods), mods


def test_engine_config_round_trips_through_json():
    cfg = make_config()
    data = json.loads(json.dumps(cfg.to_dict()))
    assert EngineConfig.from_dict(data) == cfg
    assert EngineConfig.from_dict(data).to_dict() == data
    assert cfg.kv_bytes_per_token == kv_bytes_per_token(MODEL, "bfloat16") == 2 * 2 * 2 * 16 * 2 == 256
    assert cfg.tp_size == 1 and cfg.torch_kv_dtype == torch.bfloat16


def test_engine_config_optional_keys_take_their_defaults():
    data = make_config().to_dict()
    del data["model"]["sliding_window"], data["tokenizer"]["bos_token_id"]
    cfg = EngineConfig.from_dict(data)
    assert cfg.model.sliding_window == 0 and cfg.tokenizer.bos_token_id is None


def _edit(data: dict, path: str, value=..., delete: bool = False) -> dict:
    data = copy.deepcopy(data)
    *parents, key = path.split(".", 1) if path.startswith("checksums.") else path.split(".")
    node = data
    for p in parents:
        node = node[p]
    if delete:
        del node[key]
    else:
        node[key] = value
    return data


@pytest.mark.parametrize("path, value, message", [
    ("torch_version", None, "key 'torch_version' is missing"),
    ("model", None, "key 'model' is missing"),
    ("model.num_layers", None, "key 'model.num_layers' is missing"),
    ("bounds.max_seq_len", None, "key 'bounds.max_seq_len' is missing"),
    ("memory.weights_bytes", None, "key 'memory.weights_bytes' is missing"),
    ("bounds.max_seq_len", "128", "'bounds.max_seq_len' must be an integer, got '128'"),
    ("bounds.tokens_per_block", 8.0, "'bounds.tokens_per_block' must be an integer, got 8.0"),
    ("bounds.max_batch_size", True, "'bounds.max_batch_size' must be an integer, got True"),
    ("model.vocab_size", [512], "'model.vocab_size' must be an integer"),
    ("model.norm_eps", "small", "'model.norm_eps' must be a number"),
    ("model.tie_word_embeddings", 1, "'model.tie_word_embeddings' must be true or false"),
    ("model.rope_scaling", "linear", "'model.rope_scaling' must be a JSON object"),
    ("model", [1, 2], "'model' must be a JSON object"),
    ("tokenizer.eos_token_ids", [2, "3"], "'tokenizer.eos_token_ids[1]' must be an integer"),
    ("engine_files", "rank0.engine", "'engine_files' must be a list"),
    ("backend", 3, "'backend' must be a string"),
    ("bounds.max_tokens", 4, "unknown key(s) ['bounds.max_tokens']"),
    ("io", {}, "unknown key(s) ['io']"),
    ("dtype", "fp8", "dtype='fp8' is not one of"),
    ("quantization", "int3", "quantization='int3' is not one of"),
    ("bounds.max_seq_len", 0, "bounds.max_seq_len=0: bounds must be >= 1"),
    ("engine_files", ["engine.pt2"], "engine_files=['engine.pt2'] must be rank0.engine"),
    ("checksums", None, "key 'checksums' is missing"),
    ("checksums", {"tokenizer.json": SHA}, "checksums has no entry for rank0.engine"),
    ("checksums", {"rank0.engine": SHA, "tokenizer.json": SHA}, "checksums has no entry for rank0.weights"),
    ("checksums.rank0.engine", "abc", "checksums['rank0.engine']='abc' is not 'sha256:' and 64 hex digits"),
    ("checksums", {"rank0.engine": SHA, "../x": SHA}, "checksums names '../x', not a file of the engine directory"),
    ("checksums.tokenizer.json", 5, "'checksums.tokenizer.json' must be a string"),
    ("model.num_kv_heads", 0, "model.num_kv_heads=0"),
    ("model.vocab_size", -1, "model.vocab_size=-1"),
    ("model.norm_eps", float("nan"), "'model.norm_eps' must be a finite number, got nan"),
    ("model.rope_theta", float("inf"), "'model.rope_theta' must be a finite number"),
    ("model.sliding_window", -8, "model.sliding_window=-8 must be >= 0"),
    ("tokenizer.eos_token_ids", [2, 600], "tokenizer.eos_token_ids [600] are outside the vocabulary [0, 512)"),
    ("memory.weights_bytes", -5, "memory.weights_bytes=-5 must be >= 0"),
    ("tensor_parallel", None, "key 'tensor_parallel' is missing"),
    ("tensor_parallel.tp_size", 2, "engine_files=['rank0.engine'] must be rank0.engine .. rank1.engine"),
    ("tensor_parallel.num_heads_per_rank", 2, "tensor_parallel.num_heads_per_rank=2, but LlamaForCausalLM over 1 "
                                              "rank(s) gives 4"),
    ("tensor_parallel.tp_size", 3, "tensor_parallel: tp_size=3 does not divide num_heads=4"),
])
def test_each_bad_key_is_named(path, value, message):
    data = _edit(make_config().to_dict(), path, value, delete=value is None)
    with pytest.raises(EngineLoadError) as exc:
        EngineConfig.from_dict(data, "eng/config.json")
    assert message in str(exc.value) and str(exc.value).startswith("eng/config.json: ")
    assert "rebuild" in str(exc.value)


@pytest.mark.parametrize("version", [str(FORMAT_VERSION), float(FORMAT_VERSION), True, None, 1, 2, 3, 4,
                                     FORMAT_VERSION + 1])
def test_format_version_must_be_a_supported_integer(version):
    data = make_config().to_dict()
    data["format_version"] = version
    with pytest.raises(EngineLoadError, match=r"engine format version .* is not supported.*rebuild the engine"):
        EngineConfig.from_dict(data)


def test_engines_of_format_1_get_the_rebuild_error(tmp_path):
    """An engine written before the contract (format 1: bounds inside `build`, an `io` block, eos ids at
    the top level) is refused before any of its keys is read, with the rebuild message."""
    old = {
        "format_version": 1, "kiln_version": "0.1.0", "torch_version": torch.__version__, "backend": "cpu",
        "model": MODEL.to_dict(),
        "build": {"dtype": "float32", "max_batch_size": 4, "max_num_tokens": 64, "max_seq_len": 64,
                  "tokens_per_block": 8, "kv_cache_dtype": "float32", "max_blocks_per_seq": 8, "max_num_logits": 4},
        "eos_token_ids": [2], "bos_token_id": 1, "io": {"inputs": []}, "memory": {"kv_bytes_per_token": 512},
        "tokenizer_files": [], "engine_files": ["rank0.engine"],
    }
    (tmp_path / "config.json").write_text(json.dumps(old))
    with pytest.raises(EngineLoadError, match=r"format version 1 \(built by kiln 0\.1\.0\).*reads format\(s\) "
                                              rf"\[{FORMAT_VERSION}\]; rebuild the engine with this kiln's "
                                              "build-engine"):
        read_engine_config(tmp_path)


def test_read_engine_config_checks_the_file_and_compatibility(tmp_path):
    with pytest.raises(EngineLoadError, match="not an engine directory"):
        read_engine_config(tmp_path / "nowhere")
    with pytest.raises(EngineLoadError, match=r"config\.json: missing"):
        read_engine_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(EngineLoadError, match="not a JSON object"):
        read_engine_config(tmp_path)
    make_config().write(tmp_path)
    assert read_engine_config(tmp_path) == make_config()
    make_config(backend="openvino").write(tmp_path)
    with pytest.raises(EngineLoadError, match="backend 'openvino' cannot run here"):
        read_engine_config(tmp_path)
    # an ONNX model or a TensorRT plan does not depend on torch's version; whether their runtime (and a GPU)
    # is here is checked when the engine is loaded, so their config reads anywhere (kiln inspect)
    for backend in ("onnx", "tensorrt"):
        make_config(backend=backend, torch_version="2.1.0").write(tmp_path)
        assert read_engine_config(tmp_path).backend == backend
    make_config(backend="cpu", torch_version="2.1.0").write(tmp_path)
    with pytest.raises(EngineLoadError, match="cannot be loaded by torch"):
        read_engine_config(tmp_path)


def test_kv_pool_shape_and_io_spec():
    cfg = make_config()
    assert kv_cache_shape(MODEL, 8, 5, "bfloat16") == (2, 2, 5, 8, 2, 16)
    spec = io_spec(cfg)
    assert [i["name"] for i in spec["inputs"]][-1] == "kv_cache"
    assert spec["inputs"][-1] == {"name": "kv_cache", "dtype": "bfloat16", "shape": [2, 2, "num_blocks", 8, 2, 16]}
    assert spec["dims"] == {"num_seqs": [1, 4], "num_logits": [0, 4], "num_tokens": [1, 64],
                            "max_blocks_per_seq": [1, 8], "num_blocks": [1, None]}
    assert spec["outputs"] == [{"name": "logits", "dtype": "float32", "shape": ["num_logits", 512]}]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_8bit_kv_pool_holds_its_scales(kv):
    """An 8-bit pool's rows are head_dim numbers + a 2-byte scale: the shape, the bytes per token (what the
    runtime sizes the pool by, the planner and the summary count) and the input check all include them."""
    cfg = make_config(kv_cache_dtype=kv)
    pool_dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    assert cfg.torch_kv_dtype == pool_dtype and kv_row_size(16, kv) == 18 and kv_row_size(16, "float32") == 16
    assert kv_cache_shape(MODEL, 8, 5, kv) == (2, 2, 5, 8, 2, 18)
    assert cfg.kv_bytes_per_token == kv_bytes_per_token(MODEL, kv) == 2 * 2 * 2 * (16 + 2) == 144
    assert cfg.kv_bytes_per_token / kv_bytes_per_token(MODEL, "float32") <= 0.29   # 18 / 64 bytes per row here
    assert io_spec(cfg)["inputs"][-1] == {"name": "kv_cache", "dtype": kv, "shape": [2, 2, "num_blocks", 8, 2, 18]}
    rows = dict(summary_rows(cfg))
    assert rows["KV bytes/token"] == "144 B" and rows["KV tokens in 1 GiB"] == f"{(1 << 30) // 144:,}"
    pool = torch.zeros(kv_cache_shape(MODEL, 8, 3, kv), dtype=pool_dtype)
    check_inputs(pack_inputs([SeqChunk([1, 2, 3], 0, [2])], pool, 8), cfg)
    for wrong in (torch.zeros(kv_cache_shape(MODEL, 8, 3, "float32")),                # a float pool
                  torch.zeros(kv_cache_shape(MODEL, 8, 3, "float32"), dtype=pool_dtype)):  # no room for the scales
        with pytest.raises(EngineInputError, match=rf"this engine needs {pool_dtype} \[2, 2, num_blocks, 8, 2, 18\]"):
            check_inputs(pack_inputs([SeqChunk([1, 2, 3], 0, [2])], wrong, 8), cfg)


def test_packer_lays_out_a_mixed_step():
    kv = torch.zeros(kv_cache_shape(MODEL, 4, 10, "float32"))
    chunks = [
        SeqChunk([11, 12, 13, 14, 15], start=3, block_ids=[7, 2], num_logits=1),   # a chunk after 3 cached tokens
        SeqChunk([21, 22], start=0, block_ids=[5], num_logits=0),                   # a non-final prefill chunk
        SeqChunk([31], start=8, block_ids=[0, 1, 9], num_logits=1),                 # a decode
    ]
    inp = pack_inputs(chunks, kv, tokens_per_block=4)
    assert inp["input_ids"].tolist() == [11, 12, 13, 14, 15, 21, 22, 31]
    assert inp["position_ids"].tolist() == [3, 4, 5, 6, 7, 0, 1, 8]
    assert inp["seq_lens"].tolist() == [5, 2, 1] and inp["context_lens"].tolist() == [8, 2, 9]
    assert inp["slot_mapping"].tolist() == [7 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4, 5 * 4 + 1, 9 * 4]
    assert inp["block_tables"].tolist() == [[7, 2, 0], [5, 0, 0], [0, 1, 9]]
    assert inp["logits_indices"].tolist() == [4, 7] and inp["kv_cache"] is kv
    assert pack_inputs(chunks[:1], kv, 4, block_table_width=5)["block_tables"].shape == (1, 5)
    assert pack_inputs([SeqChunk([1, 2, 3], 0, [4], 3)], kv, 4)["logits_indices"].tolist() == [0, 1, 2]
    with pytest.raises(EngineInputError, match="has 1 blocks of 4 tokens"):
        pack_inputs([SeqChunk([1, 2], start=3, block_ids=[4])], kv, 4)


def test_check_inputs_names_the_input():
    cfg = make_config(kv_cache_dtype="float32")
    kv = torch.zeros(kv_cache_shape(MODEL, 8, 6, "float32"))
    ok = pack_inputs([SeqChunk([1, 2, 3], 0, [3])], kv, 8)
    check_inputs(ok, cfg)
    with pytest.raises(EngineInputError, match=r"num_tokens \(input_ids\) = 65 is outside .* range \[1, 64\]"):
        check_inputs(pack_inputs([SeqChunk(list(range(65)), 0, list(range(6)) * 2)], kv, 8), cfg)
    with pytest.raises(EngineInputError, match="slot_mapping has 2 rows, expected 3"):
        check_inputs({**ok, "slot_mapping": ok["slot_mapping"][:2]}, cfg)
    with pytest.raises(ValueError, match="kv_cache is torch.bfloat16"):   # EngineInputError is a ValueError
        check_inputs({**ok, "kv_cache": kv.bfloat16()}, cfg)


def test_summary_rows_name_what_both_clis_print():
    report = {"gemms": {"before_passes": 9, "after_passes": 5}, "timings_s": {"total": 1.5}}
    rows = dict(summary_rows(make_config(), report))
    assert rows["model"] == "LlamaForCausalLM (2 layers, hidden 64, vocab 512)"
    assert rows["KV bytes/token"] == "256 B" and rows["GEMMs before/after passes"] == "9 -> 5"
    assert rows["format / kiln / torch"].startswith(f"{FORMAT_VERSION} / 0.1.0 / ")
    table = format_table(list(rows.items())).splitlines()
    assert table[0] == table[-1] and set(table[0]) == {"-"} and "limits" in table[3]


@pytest.mark.parametrize("version, dropped", [(2, ("checksums", "tensor_parallel")), (3, ("tensor_parallel",)),
                                              (4, ())])
def test_engines_of_formats_2_to_4_get_the_rebuild_error(version, dropped):
    """Format 2 (before checksums), 3 (before the tensor-parallel mapping and rank stamps) and 4 (weights inside
    the graph files) are refused like format 1: rebuilt, not guessed at."""
    data = make_config().to_dict()
    data["format_version"] = version
    for key in dropped:
        del data[key]
    with pytest.raises(EngineLoadError, match=rf"format version {version} .*reads format\(s\) \[{FORMAT_VERSION}\]; "
                                              r"rebuild the engine"):
        EngineConfig.from_dict(data)


def _leaves(node, prefix=()):
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _leaves(v, (*prefix, k))
    elif isinstance(node, list) and node:
        for i, v in enumerate(node):
            yield from _leaves(v, (*prefix, i))
    else:
        yield prefix


HOSTILE_VALUES = [None, "x", -1, 0, 1.5, float("nan"), True, [], {}, [1], 2**70]


def test_any_damaged_key_gives_an_engine_load_error_or_a_usable_config():
    """Every key of config.json deleted or replaced by each hostile value: reading it, and everything the
    runtime and the CLIs derive from it, raise EngineLoadError or work -- never a KeyError/TypeError."""
    good = make_config().to_dict()
    cases = held = 0
    for path in _leaves(good):
        if path[0] == "build":
            continue   # the builder's knobs, read only by BuildConfig.from_dict on a rebuild
        for value in [...] + HOSTILE_VALUES:
            data = copy.deepcopy(good)
            node = data
            for key in path[:-1]:
                node = node[key]
            if value is ...:
                del node[path[-1]]
            else:
                node[path[-1]] = value
            cases += 1
            try:
                cfg = EngineConfig.from_dict(json.loads(json.dumps(data)))
                summary_rows(cfg)
                io_spec(cfg)
                kv_cache_shape(cfg.model, cfg.bounds.tokens_per_block, 4, cfg.kv_cache_dtype)
                assert cfg.kv_bytes_per_token > 0
            except EngineLoadError:
                pass
            held += 1
    assert held == cases > 500


def test_tensor_parallel_mapping_splits_heads_mlp_and_vocab():
    m = TensorParallelMapping.plan(MODEL, 2, build_id="x")
    assert (m.num_heads_per_rank, m.num_kv_heads_per_rank, m.kv_head_replicas) == (2, 1, 1)
    assert (m.intermediate_size_per_rank, m.vocab_size_per_rank) == (96, 256)
    assert [list(m.kv_heads(r)) for r in range(2)] == [[0], [1]]
    rank = m.rank_model(MODEL)
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size, rank.vocab_size) == (2, 1, 96, 512)
    cfg = make_config(engine_files=["rank0.engine", "rank1.engine"], tensor_parallel=m,
                      checksums={"rank0.engine": SHA, "rank1.engine": SHA, "rank0.weights": SHA, "rank1.weights": SHA})
    assert cfg.tp_size == 2 and cfg.kv_bytes_per_token == 256 // 2       # one rank's pool holds half the KV heads
    assert EngineConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    check_inputs(pack_inputs([SeqChunk([1, 2], 0, [0])], torch.zeros(kv_cache_shape(rank, 8, 2, "bfloat16"),
                                                                      dtype=torch.bfloat16), 8), cfg)
    assert io_spec(cfg)["inputs"][-1]["shape"] == [2, 2, "num_blocks", 8, 1, 16]
    rows = dict(summary_rows(cfg))
    assert rows["tensor parallel"].startswith("2 ranks, each: 2 heads, 1 KV head(s), MLP 96, LM head 256 vocab rows")
    assert rows["KV bytes/token"] == "128 B per rank (256 B over 2 ranks)"


def test_tensor_parallel_mapping_replicates_kv_heads_and_pads_the_vocabulary():
    import dataclasses

    m = TensorParallelMapping.plan(MODEL, 4)             # 2 KV heads over 4 ranks: each held by 2 ranks
    assert (m.num_heads_per_rank, m.num_kv_heads_per_rank, m.kv_head_replicas) == (1, 1, 2)
    assert [list(m.kv_heads(r)) for r in range(4)] == [[0], [0], [1], [1]]
    mqa = dataclasses.replace(MODEL, num_kv_heads=1, vocab_size=511)
    m = TensorParallelMapping.plan(mqa, 2)
    assert (m.num_kv_heads_per_rank, m.kv_head_replicas, m.vocab_size_per_rank) == (1, 2, 256)
    assert "replicated on 2 ranks" in m.describe(mqa) and "(1 padding)" in m.describe(mqa)
    assert TensorParallelMapping.plan(MODEL, 1).rank_model(MODEL) is MODEL


@pytest.mark.parametrize("changes, tp, message", [
    ({}, 3, "tp_size=3 does not divide num_heads=4: each rank takes whole attention heads; use a tp_size that "
            "divides 4 ([1, 2, 4])"),
    ({}, 8, "tp_size=8 is larger than the model's num_heads=4"),
    ({}, 0, "tp_size=0 must be a positive integer"),
    ({"num_heads": 6, "num_kv_heads": 3}, 2, "tp_size=2 and num_kv_heads=3: KV heads are either split"),
    ({"intermediate_size": 190}, 4, "tp_size=4 does not divide intermediate_size=190"),
])
def test_invalid_tensor_parallel_splits_name_the_numbers(changes, tp, message):
    import dataclasses

    with pytest.raises(BuildConfigError, match="cannot split the model over tensor-parallel ranks") as exc:
        TensorParallelMapping.plan(dataclasses.replace(MODEL, **changes), tp)
    assert message in str(exc.value)


def test_rank_files_are_checked_by_their_stamp(tmp_path):
    import zipfile

    mapping = TensorParallelMapping.plan(MODEL, 2, build_id="build-a")

    def rank_archive(name: str) -> str:
        with zipfile.ZipFile(tmp_path / name, "w") as z:
            z.writestr("archive/data.bin", b"weights")
        return name

    stamp_rank_file(tmp_path / rank_archive("rank1.engine"), 1, mapping)
    assert check_rank_file(tmp_path, mapping, 1, "rank1.engine") == tmp_path / "rank1.engine"
    with pytest.raises(EngineLoadError, match=r"rank0\.engine: missing \(rank 0 of 2\)"):
        check_rank_file(tmp_path, mapping, 0, "rank0.engine")
    (tmp_path / "rank0.engine").write_bytes((tmp_path / "rank1.engine").read_bytes())   # a copy of rank 1
    with pytest.raises(EngineLoadError, match=r"rank0\.engine: holds rank 1 of 2 \(build build-a\), but config\.json "
                                              r"expects rank 0 of 2"):
        check_rank_file(tmp_path, mapping, 0, "rank0.engine")
    other = TensorParallelMapping.plan(MODEL, 2, build_id="build-b")
    with pytest.raises(EngineLoadError, match=r"rank1\.engine: holds rank 1 of 2 \(build build-a\).*\(build build-b\)"):
        check_rank_file(tmp_path, other, 1, "rank1.engine")
    with pytest.raises(EngineLoadError, match=r"rank2\.engine: carries no readable rank stamp"):
        check_rank_file(tmp_path, mapping, 2, rank_archive("rank2.engine"))
    (tmp_path / "rank3.engine").write_bytes(b"not a zip")
    with pytest.raises(EngineLoadError, match=r"rank3\.engine: corrupt engine file"):
        check_rank_file(tmp_path, mapping, 3, "rank3.engine")
