"""LoRA adapters over the OpenAI server: `--lora-modules` adapters are models by name (greedy text equal to the
offline LLM with the same adapter, which tests/lora checks against HF + PEFT), /v1/models lists them with their
parent, an unknown model is a 404 in OpenAI form, and the runtime load / unload routes (only with
VLSERVE_ALLOW_RUNTIME_LORA_UPDATING=1) with their 4xx errors; the same through an engine process (control calls)."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.api.conftest import TEXT_ENGINE_KW, start_server

PROMPT = "the quick brown fox jumps over"
LORA_KW = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


def make_adapter(model_dir: str, out_dir, targets, seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    get_peft_model(base, cfg).save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.fixture(scope="module")
def adapters(text_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("api_lora")
    return {
        "sql": make_adapter(text_ckpt, root / "sql", ["q_proj", "v_proj", "down_proj"], 1),
        "chatty": make_adapter(text_ckpt, root / "chatty", ["k_proj", "o_proj", "up_proj"], 2),
        "late": make_adapter(text_ckpt, root / "late", ["q_proj", "gate_proj"], 3),
    }


@pytest.fixture(scope="module")
def reference(text_ckpt, adapters):
    """name (None: base) -> the offline LLM's greedy completion text of PROMPT."""
    from vlserve import LLM, SamplingParams
    from vlserve.lora import LoRARequest

    llm = LLM(text_ckpt, **TEXT_ENGINE_KW, **LORA_KW)
    names = [None, "sql", "chatty", "late"]
    loras = [None] + [LoRARequest(n, i + 1, adapters[n]) for i, n in enumerate(names[1:])]
    outs = llm.generate(
        [PROMPT] * 4, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False, lora_request=loras
    )
    llm.shutdown()
    return {n: o.outputs[0].text for n, o in zip(names, outs)}


def complete(served, model: str) -> str:
    return (
        served.client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )


def check_server(served, adapters, reference, base: str) -> None:
    assert len(set(reference.values())) == 4  # the adapters change the text
    assert complete(served, "sql") == reference["sql"]
    assert complete(served, "chatty") == reference["chatty"]
    assert complete(served, base) == reference[None]
    chat = served.client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0
    )
    assert chat.model == "sql"
    cards = {m["id"]: m for m in served.http.get("/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == base and cards["sql"]["root"] == adapters["sql"]
    assert cards[base]["parent"] is None and set(cards) == {base, "sql", "chatty"}
    with pytest.raises(openai.NotFoundError) as e:
        complete(served, "no-such-adapter")
    assert e.value.body["type"] == "NotFoundError" and e.value.body["param"] == "model"

    # runtime updates: load "late", use it, refuse duplicates / bad paths / unknown names, unload it
    r = served.http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["late"]})
    assert r.status_code == 200, r.text
    assert complete(served, "late") == reference["late"]
    assert served.http.get("/v1/models").json()["data"][-1]["id"] == "late"
    for body, status in (
        ({"lora_name": "late", "lora_path": adapters["late"]}, 400),  # loaded twice
        ({"lora_name": "sql", "lora_path": adapters["late"]}, 400),
        ({"lora_name": base, "lora_path": adapters["late"]}, 400),
        ({"lora_name": "bad", "lora_path": "/no/such/dir"}, 400),
        ({"lora_name": "bad"}, 400),
    ):
        r = served.http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == status and r.json()["error"]["message"], (body, r.text)
    r = served.http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200, r.text
    r = served.http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        complete(served, "late")
    assert complete(served, "sql") == reference["sql"]  # the others still served
    served.wait_idle()


def lora_args(text_ckpt, adapters):
    from vlserve.config import EngineArgs

    return EngineArgs(
        model=text_ckpt,
        served_model_name="base",
        **TEXT_ENGINE_KW,
        **LORA_KW,
        lora_modules=[f"sql={adapters['sql']}", f"chatty={adapters['chatty']}"],
    )


def test_lora_models_over_the_server(text_ckpt, adapters, reference, monkeypatch):
    monkeypatch.setenv("VLSERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    served = start_server(lora_args(text_ckpt, adapters))
    try:
        check_server(served, adapters, reference, "base")
    finally:
        served.close()


def test_lora_models_with_the_engine_in_its_own_process(text_ckpt, adapters, reference, monkeypatch):
    from test_engine_process import start_proc_server

    monkeypatch.setenv("VLSERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    served = start_proc_server(lora_args(text_ckpt, adapters))
    try:
        check_server(served, adapters, reference, "base")
    finally:
        served.close()


def test_runtime_routes_need_the_env_var_and_lora_requests_need_lora(server, monkeypatch):
    monkeypatch.delenv("VLSERVE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    r = server.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert r.status_code == 404
    assert "parent" in server.http.get("/v1/models").json()["data"][0]
