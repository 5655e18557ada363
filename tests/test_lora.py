"""Multi-LoRA serving against transformers + peft's PeftModel on the same random checkpoints.

Adapters are made with peft (ranks 4, 8 and 16, different target sets, rsLoRA on one, B not zero) and saved as
PEFT writes them; kiln's greedy outputs must equal PeftModel's for each adapter and for the base model, in one
mixed batch of 32 requests with preemption and prefix reuse on (llama and gpt2, whose fused c_attn kiln splits
into q/k/v), with more adapters than pool slots (LRU swap), and the prefix cache never shares KV between
adapters; Phi-3 (fused qkv_proj / gate_up_proj), Gemma 3 and Qwen3-MoE (attention only) in a smaller mixed
batch. Then the refusals: a rank above the engine's, a module it does not adapt, wrong shapes, a missing
file, an unknown adapter name, an engine without adapters.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from kiln.contract import AdapterLoadError, BuildConfigError, ConfigError, InvalidRequestError
from kiln.runtime import LLM, SamplingParams

from runtime_support import assert_no_leak, get_engine

VOCAB = 512
MAX_RANK = 16
TARGETS = {"llama": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "gpt2": "all-linear"}
ADAPTERS = {   # name -> peft LoraConfig arguments, per family
    "llama": {
        "a4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "a8": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
        "a16": dict(r=16, lora_alpha=24, target_modules=["o_proj", "gate_proj", "down_proj", "k_proj"]),
    },
    "gpt2": {
        "a4": dict(r=4, lora_alpha=8, target_modules=["c_attn"]),
        "a8": dict(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], use_rslora=True),
        "a16": dict(r=16, lora_alpha=24, target_modules=["c_fc", "c_proj"]),
    },
}
MAX_TOKENS = 8
_REFS: dict[tuple, list[int]] = {}


def _hf_model(ckpt: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def make_adapter(ckpt: Path, out: Path, seed: int, **config) -> Path:
    """A PEFT LoRA adapter of ``ckpt`` with random A and B (B is zero at peft's default init), saved by peft."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(_hf_model(ckpt), LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():   # a delta large enough to change greedy tokens of the random model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    model.save_pretrained(out)
    return out


def peft_greedy(ckpt: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    """PeftModel's (or the base model's) greedy tokens for ``prompt`` alone, cached per adapter and prompt."""
    key = (str(ckpt), str(adapter), tuple(prompt))
    if key not in _REFS:
        model = _hf_model(ckpt)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter).eval()
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=1 << 30, pad_token_id=0)
        _REFS[key] = out[0, len(prompt):].tolist()
    return _REFS[key]


@pytest.fixture(scope="module")
def setups(checkpoint_dir, tmp_path_factory):
    """family -> (checkpoint, engine taking adapters, {adapter name: directory})."""
    out = {}
    for fam in ("llama", "gpt2"):
        ckpt = checkpoint_dir(fam)
        engine = get_engine(ckpt, lora_target_modules=TARGETS[fam], max_lora_rank=MAX_RANK)
        root = tmp_path_factory.mktemp(f"lora-{fam}")
        adapters = {name: make_adapter(ckpt, root / name, seed, **cfg)
                    for seed, (name, cfg) in enumerate(ADAPTERS[fam].items())}
        out[fam] = (ckpt, engine, adapters)
    return out


def mixed_workload(seed: int) -> tuple[list[list[int]], list[str | None]]:
    """32 requests: 8 prompts (half of them on a common 16-token prefix) under the base model and 3 adapters."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(16)]
    prompts = [(prefix if i % 2 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 20))]
               for i in range(8)]
    names = [None, "a4", "a8", "a16"]
    return [p for p in prompts for _ in names], [n for _ in prompts for n in names]


def check_against_peft(ckpt, adapters, prompts, names, outs) -> None:
    bad = []
    for p, n, o in zip(prompts, names, outs):
        want = peft_greedy(ckpt, adapters[n] if n else None, p)
        if o.token_ids != want:
            bad.append(f"adapter {n}, prompt {p[:6]}...: kiln {o.token_ids} != peft {want}")
    assert not bad, "\n".join(bad)


def check_pool(llm) -> None:
    assert_no_leak(llm)
    pool = llm.executor.adapter_pool
    pool.check_consistency()
    assert llm.stats()["lora"]["in_use"] == 0


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_mixed_batch_of_adapters_matches_peft(setups, family):
    ckpt, engine, adapters = setups[family]
    prompts, names = mixed_workload(seed=7)
    for name in adapters:   # each adapter changes the model: the equality below could fail
        assert peft_greedy(ckpt, adapters[name], prompts[0]) != peft_greedy(ckpt, None, prompts[0]), name
    with LLM(engine, lora_modules=adapters, max_loras=3, capacity_policy="max_utilization",
             max_kv_cache_tokens=160) as llm:
        outs = llm.generate(prompts, GREEDY, lora=names, timeout=300)
        check_against_peft(ckpt, adapters, prompts, names, outs)
        stats = llm.stats()
        assert stats["counters"]["preemptions"] > 0, "the pool was large enough: nothing was preempted"
        assert stats["kv_cache"]["prefix_hits"] > 0
        assert max(s.batch_size for s in llm.executor.metrics.steps) >= 8
        check_pool(llm)


# The other families, one engine each: PEFT's module names for their layouts (Phi-3's fused qkv_proj and
# gate_up_proj, split by kiln; an MoE model's attention), each adapter checked in one mixed batch
FAMILY_ADAPTERS = {
    "phi3": {"f8": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
             "f4": dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "down_proj"])},
    "gemma3": {"f8": dict(r=8, lora_alpha=16, target_modules="all-linear"),
               "f4": dict(r=4, lora_alpha=12, target_modules=["k_proj", "o_proj", "up_proj"])},
    "qwen3_moe": {"f8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
                  "f4": dict(r=4, lora_alpha=8, target_modules=["v_proj"], use_rslora=True)},
}


@pytest.mark.parametrize("family", sorted(FAMILY_ADAPTERS))
def test_other_families_match_peft(checkpoint_dir, tmp_path, family):
    ckpt = checkpoint_dir(family)
    engine = get_engine(ckpt, lora_target_modules="all-linear", max_lora_rank=8)
    adapters = {name: make_adapter(ckpt, tmp_path / name, seed, **cfg)
                for seed, (name, cfg) in enumerate(FAMILY_ADAPTERS[family].items())}
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    names = [None, *adapters]
    for name in adapters:
        assert peft_greedy(ckpt, adapters[name], prompts[0]) != peft_greedy(ckpt, None, prompts[0]), name
    with LLM(engine, lora_modules=adapters, max_loras=2) as llm:
        outs = llm.generate([p for p in prompts for _ in names], GREEDY, lora=names * len(prompts), timeout=300)
        check_against_peft(ckpt, adapters, [p for p in prompts for _ in names], names * len(prompts), outs)
        check_pool(llm)


def test_moe_families_adapt_attention_only(checkpoint_dir, tmp_path):
    from kiln.builder import BuildConfig, build_engine

    with pytest.raises(BuildConfigError, match=r"\['gate_proj'\] match no module of MixtralForCausalLM; its modules "
                                               r"are \['self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj', "
                                               r"'self_attn.o_proj'\]"):
        build_engine(checkpoint_dir("mixtral"), tmp_path / "e", BuildConfig(lora_target_modules="q_proj,gate_proj"))

def test_more_adapters_than_slots_swap_lru_and_stay_exact(setups):
    ckpt, engine, adapters = setups["llama"]
    prompts, names = mixed_workload(seed=8)
    with LLM(engine, lora_modules=adapters, max_loras=1) as llm:
        outs = llm.generate(prompts, GREEDY, lora=names, timeout=300)
        check_against_peft(ckpt, adapters, prompts, names, outs)
        lora = llm.stats()["lora"]
        assert lora["max_loras"] == 1 and lora["evictions"] >= 2 and sorted(lora["loaded"]) == sorted(adapters)
        check_pool(llm)
        # one at a time, in turn: each request swaps its adapter in (the least recently used goes)
        for name in ["a4", "a8", "a4", "a16"]:
            (out,) = llm.generate([prompts[0]], GREEDY, lora=name, timeout=60)
            assert out.token_ids == peft_greedy(ckpt, adapters[name], prompts[0])
            assert llm.executor.adapter_pool.resident() == [name]
        check_pool(llm)


def test_prefix_cache_never_shares_kv_between_adapters(setups):
    ckpt, engine, adapters = setups["llama"]
    prompt = list(range(10, 43))   # 4 full blocks and one token
    with LLM(engine, lora_modules=adapters, max_loras=2) as llm:
        def cached(name, path=None):
            (out,) = llm.generate([prompt], GREEDY, lora=name, timeout=60)
            assert out.token_ids == peft_greedy(ckpt, path or (adapters[name] if name else None), prompt)
            return out.metrics.num_cached_tokens

        assert [cached(n) for n in ("a4", "a8", None, "a4", "a8", None)] == [0, 0, 0, 32, 32, 32]
        llm.unload_lora("a4")   # loaded again under the same name: other weights may be behind it
        llm.load_lora("a4", adapters["a16"])
        assert cached("a4", adapters["a16"]) == 0
        check_pool(llm)


def test_unload_refuses_new_requests_and_lets_running_ones_finish(setups):
    ckpt, engine, adapters = setups["llama"]
    with LLM(engine, lora_modules={"a8": adapters["a8"]}) as llm:
        stream = llm.stream([5, 6, 7, 8], GREEDY, lora="a8")
        first = next(stream)
        llm.unload_lora("a8")
        last = list(stream)[-1] if not first.finished else first
        assert last.token_ids == peft_greedy(ckpt, adapters["a8"], [5, 6, 7, 8])
        with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'a8'; loaded adapters: \\[\\]"):
            llm.generate([[5, 6]], GREEDY, lora="a8")
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'a8' is loaded"):
            llm.unload_lora("a8")
        check_pool(llm)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_adapters_are_refused_at_load_naming_the_problem(setups, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt, engine, adapters = setups["llama"]
    rank32 = make_adapter(ckpt, tmp_path / "r32", 0, r=32, lora_alpha=32, target_modules=["q_proj"])
    other_model = setups["gpt2"][2]["a4"]   # an adapter of GPT-2's c_attn
    shapes = _copy(adapters["a4"], tmp_path / "shapes")
    tensors = load_file(shapes / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("layers.1.self_attn.v_proj.lora_B.weight"))
    tensors[key] = torch.zeros(7, 4)
    save_file(tensors, shapes / "adapter_model.safetensors")
    missing = _copy(adapters["a4"], tmp_path / "missing")
    (missing / "adapter_model.safetensors").unlink()
    dora = _copy(adapters["a4"], tmp_path / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with LLM(engine, lora_modules={"a4": adapters["a4"]}) as llm:
        cases = [
            (rank32, "rank 32, above this engine's max_lora_rank 16; rebuild the engine with --max-lora-rank 32"),
            (other_model, "adapts module 'transformer.h.0.attn.c_attn', which this engine does not adapt"),
            (shapes, "model.layers.1.self_attn.v_proj' has lora_A [4, 64] and lora_B [7, 4]; rank 4 on this "
                     "engine's self_attn.v_proj needs [4, 64] and [32, 4]"),
            (missing, "adapter_model.safetensors: missing"),
            (dora, "use_dora=True: DoRA"),
            (tmp_path / "nowhere", "not a directory"),
        ]
        for path, message in cases:
            with pytest.raises(AdapterLoadError) as err:
                llm.load_lora("bad", path)
            assert message in str(err.value), str(err.value)
        with pytest.raises(AdapterLoadError, match="already loaded"):
            llm.load_lora("a4", adapters["a8"])
        assert llm.lora_names() == ["a4"]
        with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'a5'; loaded adapters: \\['a4'\\]"):
            llm.generate([[5, 6], [7, 8]], GREEDY, lora=["a4", "a5"])
        assert llm.stats()["counters"]["requests_submitted"] == 0   # nothing of the batch ran
        with pytest.raises(InvalidRequestError, match="1 LoRA adapter names"):
            llm.generate([[5, 6], [7, 8]], GREEDY, lora=["a4"])


def test_engines_without_adapters_and_backends_without_the_op_refuse(setups, tmp_path):
    from kiln.builder import BuildConfig, build_engine

    ckpt, _, adapters = setups["llama"]
    with LLM(get_engine(ckpt)) as llm:
        with pytest.raises(InvalidRequestError, match="this engine takes no LoRA adapters"):
            llm.generate([[5, 6]], GREEDY, lora="a4")
        with pytest.raises(ConfigError, match="rebuild it with --lora-target-modules"):
            llm.load_lora("a4", adapters["a4"])
        assert llm.lora_names() == []
    with pytest.raises(BuildConfigError, match="the LoRA op has no ONNX lowering yet"):
        BuildConfig(backend="onnx", lora_target_modules=["q_proj"])
    with pytest.raises(BuildConfigError, match=r"lora_target_modules \['qq_proj'\] match no module of"):
        build_engine(ckpt, tmp_path / "e", BuildConfig(lora_target_modules="q_proj,qq_proj"))


def test_cpu_compiled_engine_serves_adapters(setups):
    """The AOTInductor package calls kiln::lora through its C shim (kiln.plugins.aoti_shims: the segments, an int[],
    as a pointer and a length): the same tokens as PeftModel."""
    import zipfile

    ckpt, _, adapters = setups["llama"]
    engine = get_engine(ckpt, lora_target_modules="q_proj,v_proj,down_proj", max_lora_rank=8,
                        backend="cpu-compiled")
    assert engine.config.backend == "cpu-compiled"
    with zipfile.ZipFile(engine.directory / "rank0.engine") as z:
        src = next(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))
    assert "aoti_torch_cpu_lora(" in src and "proxy_executor_call_function(" not in src
    prompts, names = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8]], ["a4", None, "a4"]
    with LLM(engine, lora_modules={"a4": adapters["a4"]}, max_loras=1) as llm:
        outs = llm.generate(prompts, GREEDY, lora=names, timeout=120)
        check_against_peft(ckpt, adapters, prompts, names, outs)
        check_pool(llm)


def test_the_adapter_pool_is_in_the_memory_plan(setups):
    from kiln.bench.devices import get_device
    from kiln.bench.engine_facts import engine_facts
    from kiln.bench.planner import WorkloadStats, plan
    from kiln.contract import summary_rows

    _, engine, _ = setups["llama"]
    slot = engine.config.lora.slot_bytes(engine.config.torch_dtype)
    with LLM(engine, max_loras=3, kv_cache_memory_fraction=2e-5) as llm:
        ex = llm.executor
        pool_bytes = ex.adapter_pool.weights.numel() * ex.adapter_pool.weights.element_size()
        assert pool_bytes == 3 * slot and "LoRA adapter pool: 3 slots" in ex.kv_plan
        p = plan(engine_facts(engine.directory), get_device("cpu:24"), WorkloadStats.from_percentiles(40, 20),
                 available_bytes=ex.limits.available_bytes + pool_bytes, kv_cache_memory_fraction=2e-5, max_loras=3)
        assert p["memory"]["lora_adapter_pool"]["value"] == pool_bytes
        assert p["memory"]["kv_pool_blocks"]["value"] == ex.kv.num_blocks
    rows = dict(summary_rows(engine.config))
    assert rows["LoRA"].startswith(f"max rank {MAX_RANK}, modules self_attn.q_proj, ")
