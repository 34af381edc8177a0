"""The demo locator, the default EAGLE head it points spec configs at, and the entry points moved off it
(`vlserve.quickstart` for `make serve`, the EAGLE trainer in training: `python -m training.train_eagle`)."""

import pytest

import vlserve.cli
from vlserve import quickstart
from vlserve.demo import EAGLE_DIR, MODEL_DIR
from vlserve.spec_decode.config import fill_default_draft


def test_fill_default_draft_only_fills_an_eagle_config_on_the_demo_model():
    eagle = {"method": "eagle3", "num_speculative_tokens": 2}
    assert fill_default_draft(eagle, MODEL_DIR) == {**eagle, "model": EAGLE_DIR}
    assert fill_default_draft(eagle, "/elsewhere") == eagle
    assert fill_default_draft({**eagle, "model": "/my/draft"}, MODEL_DIR)["model"] == "/my/draft"
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert fill_default_draft(ngram, MODEL_DIR) == ngram
    assert fill_default_draft(None, MODEL_DIR) is None


def test_quickstart_serves_the_given_model_or_the_demo(monkeypatch):
    seen = []
    monkeypatch.setattr(vlserve.cli, "main", lambda argv: seen.append(argv) or 0)
    assert quickstart.pick_model("/some/ckpt") == ("/some/ckpt", None)
    assert quickstart.main(["--", "--port", "0"]) == 0
    assert quickstart.main(["--", "--engine-process"]) == 0
    assert quickstart.main(["/some/ckpt"]) == 0
    assert seen == [
        ["serve", MODEL_DIR, "--no-engine-process", "--served-model-name", "vlserve-demo", "--port", "0"],
        ["serve", MODEL_DIR, "--served-model-name", "vlserve-demo", "--engine-process"],
        ["serve", "/some/ckpt"],
    ]  # a given model: its engine in its own process, as `vlserve serve`


def test_the_eagle_trainer_runs_from_the_training_package(capsys):
    from training.train_eagle import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--target" in out and "python -m training.train_eagle" in out
    with pytest.raises(SystemExit) as exc:  # no longer a subcommand of the server's CLI
        vlserve.cli.main(["train-eagle", "--help"])
    assert exc.value.code == 2


def test_demo_names_resolve_to_the_shipped_checkpoints(tmp_path, monkeypatch):
    """ "vlserve-demo" / "vlserve-demo-audio" (LLM(model=...), `vlserve serve NAME`) mean the shipped directories,
    unless a local directory of that name exists; a missing checkpoint says how to build it."""
    import vlserve.demo as demo
    from vlserve.config import resolve_model_path

    assert resolve_model_path("vlserve-demo") == MODEL_DIR == resolve_model_path(None)
    assert demo.DEMO_MODELS["vlserve-demo-audio"][0] == demo.AUDIO_MODEL_DIR
    with pytest.raises(ValueError, match="unknown demo model"):
        demo.demo_model_path("vlserve-demo-video")
    monkeypatch.setitem(demo.DEMO_MODELS, "vlserve-demo-audio", (str(tmp_path / "absent"), "rebuild --out {dir}"))
    with pytest.raises(ValueError, match=r"missing or incomplete .*\(no config.json.*`rebuild --out .*absent`"):
        resolve_model_path("vlserve-demo-audio")
    local = tmp_path / "vlserve-demo-audio"
    local.mkdir()
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("vlserve-demo-audio") == "vlserve-demo-audio", "a local directory wins"


def test_the_audio_demo_checkpoint_is_shipped():
    from vlserve.config import resolve_model_path
    from vlserve.demo import AUDIO_MODEL_DIR

    assert resolve_model_path("vlserve-demo-audio") == AUDIO_MODEL_DIR
