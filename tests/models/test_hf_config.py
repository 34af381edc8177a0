"""The one reader of either transformers config layout: where `architectures` is found, and what it says when not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vlserve.models.hf_config import architectures_of, tie_word_embeddings_of, token_id_of


def test_architectures_top_level_then_nested():
    top = SimpleNamespace(architectures=["Qwen2VLForConditionalGeneration"], text_config=SimpleNamespace())
    assert architectures_of(top) == (["Qwen2VLForConditionalGeneration"], "architectures")
    nested = SimpleNamespace(
        architectures=None,  # how transformers 4.57 saves a Qwen2-VL config
        text_config=SimpleNamespace(architectures=["Qwen2VLForConditionalGeneration"]),
    )
    assert architectures_of(nested) == (["Qwen2VLForConditionalGeneration"], "text_config.architectures")


def test_missing_architectures_says_where_it_looked():
    with pytest.raises(ValueError, match="no 'architectures' entry at the top level of config.json$"):
        architectures_of(SimpleNamespace())
    with pytest.raises(ValueError, match="at the top level of config.json nor in its text_config"):
        architectures_of(SimpleNamespace(architectures=[], text_config=SimpleNamespace(architectures=None)))


def test_tie_and_token_ids_from_either_level():
    cfg = SimpleNamespace(
        tie_word_embeddings=True,
        image_token_id=7,
        text_config=SimpleNamespace(tie_word_embeddings=None, eos_token_id=3),
    )
    assert tie_word_embeddings_of(cfg) is True  # the text config sets none: the top level's
    cfg.text_config.tie_word_embeddings = False
    assert tie_word_embeddings_of(cfg) is False  # the text config's own flag wins
    assert token_id_of(cfg, "image_token_id") == 7 and token_id_of(cfg, "eos_token_id") == 3
    assert token_id_of(cfg, "video_token_id") is None
