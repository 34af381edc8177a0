"""Our RoPE inverse frequencies (vlserve.models.rope) against the installed transformers' own rope init, and the
config reader (vlserve.models.hf_config) on both spellings of the RoPE settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from vlserve.models.hf_config import rope_params_of
from vlserve.models.layers import compute_inv_freq
from vlserve.models.rope import SUPPORTED_ROPE_TYPES

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 256,
        "mscale": 0.7,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "factor": 2.0,
        "attention_factor": 1.3,
        "original_max_position_embeddings": 1024,
    },
    "yarn_untruncated": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "truncate": False,
    },
    "old_type_key": {"type": "linear", "factor": 2.0},
}


def _hf_rope_init(config) -> tuple[torch.Tensor, float]:
    """transformers' own inverse frequencies for `config`: 4.x keeps "default" in ROPE_INIT_FUNCTIONS, 5.x moved
    it to the rotary module's `compute_default_rope_parameters`."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope_type = rope_params_of(config).rope_type
    if rope_type in ROPE_INIT_FUNCTIONS:
        return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    assert rope_type == "default"
    return LlamaRotaryEmbedding.compute_default_rope_parameters(config, device=torch.device("cpu"))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_inv_freq_matches_installed_transformers(case, head_dim):
    if case == "yarn_untruncated" and "truncate" not in _yarn_source():
        pytest.skip("this transformers version's yarn has no 'truncate' option")
    cfg = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=50000.0,
        rope_scaling=CASES[case],
    )
    ours, our_scale = compute_inv_freq(cfg)
    ref, ref_scale = _hf_rope_init(cfg)
    assert ours.dtype == torch.float32 and ours.shape == (head_dim // 2,)
    assert torch.equal(ours, ref.float()), (ours - ref).abs().max()
    assert our_scale == pytest.approx(float(ref_scale), rel=0, abs=0)


def _yarn_source() -> str:
    import inspect

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return inspect.getsource(ROPE_INIT_FUNCTIONS["yarn"])


def test_mrope_section_and_theta_from_both_spellings():
    sizes = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096)
    v4 = SimpleNamespace(**sizes, rope_theta=10.0, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    v5 = SimpleNamespace(
        **sizes,
        rope_parameters={"rope_type": "default", "type": "default", "rope_theta": 10.0, "mrope_section": [2, 3, 3]},
    )
    p4, p5 = rope_params_of(v4), rope_params_of(v5)
    assert p4 == p5
    assert (p4.rope_type, p4.theta, p4.mrope_section, p4.head_dim) == ("default", 10.0, (2, 3, 3), 16)
    inv, scale = compute_inv_freq(v5)
    assert torch.equal(inv, 1.0 / (10.0 ** (torch.arange(0, 16, 2).float() / 16))) and scale == 1.0


def test_scaled_spellings_agree_and_theta_attribute_wins():
    sizes = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096)
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    v4 = SimpleNamespace(**sizes, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **scaling})
    v5 = SimpleNamespace(**sizes, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling})
    assert torch.equal(compute_inv_freq(v4)[0], compute_inv_freq(v5)[0])
    # an override set on a copied config (as EAGLE heads do) beats the dict's theta
    v5.rope_theta = 1000.0
    assert rope_params_of(v5).theta == 1000.0
    plain = SimpleNamespace(**sizes)
    assert rope_params_of(plain).theta == 10000.0 and rope_params_of(plain).rope_type == "default"


def test_unknown_rope_type_names_it_and_lists_supported():
    cfg = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "su-scaled", "rope_theta": 1e4},
    )
    with pytest.raises(ValueError) as e:
        compute_inv_freq(cfg)
    assert "'su-scaled'" in str(e.value) and all(t in str(e.value) for t in SUPPORTED_ROPE_TYPES)


def test_missing_scaling_key_is_named():
    cfg = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0},
    )
    with pytest.raises(ValueError, match="'low_freq_factor'"):
        compute_inv_freq(cfg)
