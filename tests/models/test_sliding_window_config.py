"""`hf_config.sliding_window_of`: which decoder layers slide, decided as HF's Mistral, Qwen2 and Qwen3 decide it."""

from __future__ import annotations

from types import SimpleNamespace

from vlserve.models.hf_config import sliding_window_of


def _windows(n: int = 4, **fields) -> list[int | None]:
    cfg = SimpleNamespace(**fields)
    return [sliding_window_of(cfg, i) for i in range(n)]


def test_no_window_fields_means_full_attention():  # Llama
    assert _windows(model_type="llama") == [None] * 4


def test_mistral_slides_every_layer_even_with_layer_types():
    assert _windows(model_type="mistral", sliding_window=4096) == [4096] * 4
    assert _windows(model_type="mistral", sliding_window=None) == [None] * 4
    # HF's MistralModel ignores layer_types (it warns and slides every layer)
    assert _windows(model_type="mistral", sliding_window=8, layer_types=["full_attention"] * 4) == [8] * 4


def test_layer_types_pick_the_sliding_layers():
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert _windows(model_type="qwen2", use_sliding_window=True, sliding_window=16, layer_types=types) == [
        16,
        None,
        16,
        None,
    ]


def test_use_sliding_window_false_or_no_window_turns_it_off():
    types = ["sliding_attention"] * 4
    assert _windows(model_type="qwen2", use_sliding_window=False, sliding_window=16, layer_types=types) == [None] * 4
    assert _windows(model_type="qwen3", use_sliding_window=True, sliding_window=None, layer_types=types) == [None] * 4


def test_max_window_layers_without_layer_types():  # older Qwen2/Qwen3 configs: layers >= max_window_layers slide
    assert _windows(model_type="qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=2) == [
        None,
        None,
        32,
        32,
    ]


def test_hf_configs_agree():
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    mistral = MistralConfig(num_hidden_layers=3, sliding_window=8)
    assert [sliding_window_of(mistral, i) for i in range(3)] == [8, 8, 8]
    for cls in (Qwen2Config, Qwen3Config):
        on = cls(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=1)
        assert [sliding_window_of(on, i) for i in range(4)] == [None, 64, 64, 64]
        off = cls(num_hidden_layers=4, sliding_window=64)  # use_sliding_window defaults to False
        assert [sliding_window_of(off, i) for i in range(4)] == [None] * 4
