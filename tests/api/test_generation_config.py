"""`--generation-config auto|vlserve|DIR`: default sampling parameters from generation_config.json, on real servers
(chat and completions), on `LLM`, and the start-up checks."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.api.conftest import TEXT_ENGINE_KW, start_server
from vlserve.engine.generation_config import GenerationDefaults, load_generation_defaults
from vlserve.sampling_params import SamplingParams

# Greedy with a strong repetition penalty and a short default length: each is visible in a greedy output.
CHECKPOINT_DEFAULTS = {"temperature": 0.0, "repetition_penalty": 3.0, "max_new_tokens": 6, "do_sample": True}
MESSAGES = [{"role": "user", "content": "say say say say say something"}]
NO_EOS = {"ignore_eos": True}


def write_generation_config(folder: str, values: dict) -> None:
    path = os.path.join(folder, "generation_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **values}, f)


@pytest.fixture(scope="module")
def tuned_ckpt(text_ckpt, tmp_path_factory) -> str:
    """The shared tiny text checkpoint with sampling defaults in its generation_config.json."""
    out = str(tmp_path_factory.mktemp("gen_config") / "ckpt")
    shutil.copytree(text_ckpt, out)
    write_generation_config(out, CHECKPOINT_DEFAULTS)
    return out


@pytest.fixture(scope="module")
def served(tuned_ckpt):
    from vlserve.config import EngineArgs

    s = start_server(EngineArgs(model=tuned_ckpt, served_model_name="tuned", **TEXT_ENGINE_KW))
    yield s
    s.close()


def chat(served, extra_body=NO_EOS, **kw):
    return served.client.chat.completions.create(model="tuned", messages=MESSAGES, extra_body=extra_body, **kw)


def test_load_generation_defaults(tuned_ckpt, text_ckpt, tmp_path):
    auto = load_generation_defaults("auto", tuned_ckpt)
    assert auto.values == {"temperature": 0.0, "repetition_penalty": 3.0, "max_tokens": 6}
    assert auto.source == os.path.join(tuned_ckpt, "generation_config.json")
    assert "repetition_penalty=3.0" in auto.describe() and "--generation-config vlserve" in auto.describe()
    assert load_generation_defaults("vlserve", tuned_ckpt).values == {}
    assert load_generation_defaults("auto", text_ckpt).values == {}  # eos / pad only
    assert load_generation_defaults("auto", str(tmp_path)).values == {}  # no file at all
    assert load_generation_defaults(tuned_ckpt, text_ckpt).values == auto.values  # DIR

    with pytest.raises(ValueError, match="no generation_config.json"):
        load_generation_defaults(str(tmp_path / "missing"), text_ckpt)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_generation_defaults(str(tmp_path), text_ckpt)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match="top_p"):
        load_generation_defaults(str(tmp_path), text_ckpt)


def test_apply_keeps_the_request_fields():
    defaults = GenerationDefaults({"temperature": 0.0, "top_k": 5, "max_tokens": 6}, "x")
    params = defaults.apply(SamplingParams(temperature=0.7, max_tokens=16), given={"temperature"})
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 5, 6)
    assert defaults.apply(SamplingParams(max_tokens=3), given=()).max_tokens == 3  # the smaller default
    assert defaults.apply(SamplingParams(max_tokens=None), given=()).max_tokens == 6
    assert defaults.apply(SamplingParams(max_tokens=10), given={"max_tokens"}).max_tokens == 10


def test_chat_without_the_fields_gets_the_checkpoints_defaults(served):
    default = chat(served)
    explicit = chat(served, temperature=0.0, max_tokens=6, extra_body={**NO_EOS, "repetition_penalty": 3.0})
    assert default.usage.completion_tokens == 6
    assert default.choices[0].message.content == explicit.choices[0].message.content
    plain_greedy = chat(served, temperature=0.0, max_tokens=6, extra_body={**NO_EOS, "repetition_penalty": 1.0})
    assert plain_greedy.choices[0].message.content != default.choices[0].message.content  # the request's own wins
    assert chat(served, max_completion_tokens=3).usage.completion_tokens == 3
    assert chat(served, max_tokens=9).usage.completion_tokens == 9
    again = chat(served, temperature=None)  # null is "not set"
    assert again.choices[0].message.content == default.choices[0].message.content


def test_completions_get_the_defaults_too(served):
    prompt = "one two one two one two"

    def complete(extra_body=NO_EOS, **kw):
        return served.client.completions.create(model="tuned", prompt=prompt, extra_body=extra_body, **kw)

    default = complete()
    assert default.usage.completion_tokens == 6  # the smaller of the endpoint's 16 and the checkpoint's 6
    explicit = complete(temperature=0.0, max_tokens=6, extra_body={**NO_EOS, "repetition_penalty": 3.0})
    assert default.choices[0].text == explicit.choices[0].text
    assert complete(max_tokens=10).usage.completion_tokens == 10


def test_vlserve_turns_the_defaults_off(tuned_ckpt):
    from vlserve.config import EngineArgs

    s = start_server(
        EngineArgs(model=tuned_ckpt, served_model_name="tuned", generation_config="vlserve", **TEXT_ENGINE_KW)
    )
    try:
        out = s.client.completions.create(model="tuned", prompt="one two", extra_body=NO_EOS, seed=1)
        assert out.usage.completion_tokens == 16  # the endpoint's own default, not the checkpoint's 6
    finally:
        s.close()


def test_llm_default_sampling_params(tuned_ckpt, text_ckpt):
    from vlserve import LLM

    llm = LLM(text_ckpt, generation_config=tuned_ckpt, **TEXT_ENGINE_KW)  # DIR: another folder's file
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.repetition_penalty, params.max_tokens) == (0.0, 3.0, 6)
    out = llm.generate(["hello hello"], use_tqdm=False)[0].outputs[0]
    explicit = SamplingParams(temperature=0.0, repetition_penalty=3.0, max_tokens=6)
    assert out.token_ids == llm.generate(["hello hello"], explicit, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="no generation_config.json"):
        LLM(text_ckpt, generation_config=os.path.dirname(text_ckpt) + "/nowhere", **TEXT_ENGINE_KW)


def test_serve_with_a_bad_directory_fails_at_start_up(text_ckpt, tmp_path, capsys):
    from vlserve.cli import main

    rc = main(["serve", text_ckpt, "--generation-config", str(tmp_path), "--port", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--generation-config" in err and "generation_config.json" in err


@pytest.mark.slow
def test_cli_server_logs_its_defaults_and_serves_tokenize(tuned_ckpt, repo_root):
    """`vlserve serve` (engine in its own process): one start-up log line, the defaults applied, /tokenize served."""
    import httpx

    from tests.api.conftest import serve_subprocess

    procs: list = []
    flags = [tuned_ckpt, "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "64"]
    with serve_subprocess(flags, repo_root, procs=procs) as base:
        with httpx.Client(base_url=base, timeout=60, trust_env=False) as http:
            r = http.post("/v1/completions", json={"prompt": "one two", "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
            tokens = http.post("/tokenize", json={"prompt": "one two"}).json()
            assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
            assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "one two"}
    log = procs[0].stdout.read()
    lines = [line for line in log.splitlines() if "default sampling parameters" in line]
    assert len(lines) == 1 and "repetition_penalty=3.0" in lines[0] and "max_tokens=6" in lines[0], log[-2000:]
