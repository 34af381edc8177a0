"""The demo locator, the default EAGLE head it points spec configs at, and the entry points moved off it
(`vlserve.quickstart` for `make serve`, `vlserve train-eagle` now in vlserve.training)."""
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
    assert seen == [["serve", MODEL_DIR, "--served-model-name", "vlserve-demo", "--port", "0"]]


def test_cli_train_eagle_reaches_the_training_package(capsys):
    with pytest.raises(SystemExit) as exc:
        vlserve.cli.main(["train-eagle", "--help"])
    assert exc.value.code == 0
    assert "--target" in capsys.readouterr().out
