"""LoRA adapters through `kiln serve`: --lora-modules, /v1/models with parents, model="adapter", and the
runtime loading endpoints behind --enable-lora-runtime-loading (vLLM's bodies). Outputs are checked against
the in-process LLM on the same engine and adapters (which tests/test_lora.py checks against PeftModel)."""

from __future__ import annotations

import httpx
import pytest
from test_lora import ADAPTERS, MAX_RANK, TARGETS, make_adapter, peft_greedy

from kiln.runtime import LLM, SamplingParams

from runtime_support import get_engine
from test_serving_openai import API_KEY, AUTH, MODEL, start_server

pytestmark = pytest.mark.xdist_group("serving")

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def setup(checkpoint_dir, tmp_path_factory):
    ckpt = checkpoint_dir("llama")
    engine = get_engine(ckpt, lora_target_modules=TARGETS["llama"], max_lora_rank=MAX_RANK)
    root = tmp_path_factory.mktemp("lora-serve")
    adapters = {name: make_adapter(ckpt, root / name, seed, **cfg)
                for seed, (name, cfg) in enumerate(ADAPTERS["llama"].items()) if name in ("a4", "a8")}
    return ckpt, engine, adapters


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    _, engine, adapters = setup
    s = start_server(engine.directory, tmp_path_factory.mktemp("serve-lora") / "server.log",
                     "--lora-modules", f"a4={adapters['a4']}", "--enable-lora-runtime-loading")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.log.read_text()[-3000:]


def complete(http: httpx.Client, model: str, prompt=PROMPT) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                              "ignore_eos": True})


def text_of(http: httpx.Client, model: str) -> str:
    """The completion's text, answered as ``model``."""
    r = complete(http, model)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model
    return body["choices"][0]["text"]


def test_models_list_adapters_and_model_selects_one(setup, server):
    ckpt, engine, adapters = setup
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http, \
            LLM(engine, lora_modules=adapters) as ref:
        models = http.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in models] == [
            (MODEL, None, None), ("a4", MODEL, str(adapters["a4"]))]
        assert http.get("/v1/models/a4").json()["parent"] == MODEL
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for name in ("a4", None):
            (want,) = ref.generate([PROMPT], params, lora=name)
            assert want.token_ids == peft_greedy(ckpt, adapters[name] if name else None, PROMPT)
            assert text_of(http, name or MODEL) == want.text
        r = complete(http, "a8")
        assert r.status_code == 404, r.text
        assert "'a8' does not exist here" in r.json()["error"]["message"]
        assert "LoRA adapters ['a4']" in r.json()["error"]["message"]

        # runtime loading: vLLM's bodies
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a8", "lora_path": str(adapters["a8"])})
        assert r.status_code == 200 and "a8" in r.text
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL, "a4", "a8"]
        (want,) = ref.generate([PROMPT], params, lora="a8")
        assert text_of(http, "a8") == want.text
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(adapters["a8"].parent)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        assert "adapter_config.json: missing" in r.json()["error"]["message"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a4", "lora_path": str(adapters["a8"])})
        assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a9"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a8"})
        assert r.status_code == 200
        assert complete(http, "a8").status_code == 404
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a8"})
        assert r.status_code == 400 and "no LoRA adapter named 'a8'" in r.json()["error"]["message"]
        assert httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"}
                          ).status_code == 401   # behind the API key like every /v1 route
        assert API_KEY


def test_runtime_loading_routes_need_the_flag(setup):
    from kiln.serving.openai.app import create_app

    _, engine, _ = setup
    with LLM(engine) as llm:
        paths = {r.path for r in create_app(llm, model_name=MODEL).routes}
        assert "/v1/load_lora_adapter" not in paths and "/v1/unload_lora_adapter" not in paths
        paths = {r.path for r in create_app(llm, model_name=MODEL, enable_lora_runtime_loading=True).routes}
        assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths


def test_bad_lora_modules_flag_is_a_usage_error(setup, tmp_path):
    import subprocess
    import sys

    _, engine, adapters = setup
    for spec, message in [("a4", "give NAME=PATH"), (f"a4={tmp_path}", "adapter_config.json: missing")]:
        r = subprocess.run([sys.executable, "-m", "kiln.runtime.cli", "serve", str(engine.directory), "--port", "0",
                            "--lora-modules", spec], capture_output=True, text=True, timeout=180)
        assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]


def test_triton_lora_name_and_task_id_select_an_adapter():
    import numpy as np

    from kiln.serving.triton.protocol import BadRequest, EngineLimits, parse_request

    limits = EngineLimits(vocab_size=512, max_input_len=64, max_seq_len=128)

    def parse(**extra):
        arrays = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32), "max_tokens": np.array([[4]], dtype=np.int32),
                  **extra}
        return parse_request(arrays, limits, lambda text: [], decoupled=True)

    name, task = np.array([[b"sql"]], dtype=np.object_), np.array([[7]], dtype=np.uint64)
    assert parse().lora is None
    assert parse(lora_name=name).lora == "sql"
    assert parse(lora_task_id=task).lora == "7"
    assert parse(lora_name=np.array([[b"7"]], dtype=np.object_), lora_task_id=task).lora == "7"
    with pytest.raises(BadRequest, match="lora_name 'sql' and lora_task_id 7 name different adapters"):
        parse(lora_name=name, lora_task_id=task)
    with pytest.raises(BadRequest, match="lora_task_id must be UINT64"):
        parse(lora_task_id=np.array([[0.5]], dtype=np.float32))


def test_triton_repository_carries_the_adapters(setup):
    from kiln.runtime import ConfigError
    from kiln.serving.triton.repository import RepoOptions, lora_modules, parameters

    _, engine, adapters = setup
    options = RepoOptions(lora_modules=(f"sql={adapters['a4']}", f"7={adapters['a8']}"))
    options.validate(engine.config.bounds)
    params = parameters(options, str(engine.directory))
    assert lora_modules(params["lora_modules"]) == {"sql": str(adapters["a4"]), "7": str(adapters["a8"])}
    assert params["max_loras"] == "4"
    for bad in ("sql", "sql=/a;sql=/b", '"x"=/a'):
        with pytest.raises(ConfigError, match="lora_modules"):
            lora_modules(bad)
