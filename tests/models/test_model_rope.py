"""RoPE scaling parity (llama3, linear, dynamic, yarn) and Qwen2-VL M-RoPE parity of the reusable decoder."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from vlserve.demo.checkpoints import build_text_checkpoint
from vlserve.models import load_model
from vlserve.models.layers import RotaryEmbedding, compute_inv_freq
from vlserve.models.llama import LlamaDecoderModel

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

ATOL = RTOL = 1e-4
SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},  # HF rescales only past max_position_embeddings
}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rope_scaling_matches_hf(kind, tmp_path, paged_runner, load_hf, prompts):
    arch = "qwen2" if kind == "yarn" else "llama"
    d = build_text_checkpoint(str(tmp_path), arch, max_position_embeddings=1024, rope_scaling=SCALINGS[kind])
    cfg = AutoConfig.from_pretrained(d)
    ours, ref = load_model(d, cfg, torch.float32, "cpu"), load_hf(d)
    if kind != "dynamic":  # the scaling really changes the frequencies (or, for yarn, the magnitude)
        inv, scale = compute_inv_freq(cfg)
        inv0, _ = compute_inv_freq(_unscaled(cfg))
        assert not torch.equal(inv, inv0) or scale != 1.0

    ids = (prompts[2] * 4)[:150]  # reaches positions past original_max_position_embeddings
    runner = paged_runner(ours, cfg, block_size=16)
    out = runner.step([("x", ids[:100])])
    out2 = runner.step([("x", ids[100:])])
    with torch.no_grad():
        r = ref(torch.tensor([ids]), use_cache=True)
    torch.testing.assert_close(torch.cat([out["x"], out2["x"]]), r.logits[0], atol=ATOL, rtol=RTOL)
    past, tok = r.past_key_values, int(r.logits[0, -1].argmax())
    for _ in range(3):
        out = runner.step([("x", [tok])])
        with torch.no_grad():
            r = ref(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        torch.testing.assert_close(out["x"], r.logits[0], atol=ATOL, rtol=RTOL)
        past, tok = r.past_key_values, int(r.logits[0, -1].argmax())


def _unscaled(cfg):
    """A plain-attribute copy of a text config's sizes with default RoPE (same theta)."""
    from types import SimpleNamespace

    from vlserve.models.hf_config import rope_params_of

    return SimpleNamespace(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=rope_params_of(cfg).theta,
    )


def test_unsupported_rope_type_raises(tmp_path):
    d = build_text_checkpoint(str(tmp_path), "llama")
    cfg = AutoConfig.from_pretrained(d)
    cfg.rope_parameters = cfg.rope_scaling = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(
        ValueError,
        match=r"rope type 'longrope' is not supported; supported: default, linear, "
        r"dynamic, llama3, yarn",
    ):
        load_model(d, cfg, torch.float32, "cpu")


# ---- M-RoPE: the decoder as Qwen2-VL's language model ------------------------------------------------------------


class _HiddenOnly(torch.nn.Module):
    """Adapter so PagedRunner can drive a bare decoder: compute_logits returns the hidden states."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, *args, **kw):
        return self.decoder(*args, **kw)

    def get_input_embeddings(self, ids):
        return self.decoder.get_input_embeddings(ids)

    def compute_logits(self, hidden):
        return hidden.float()


def _mrope_positions(n_text: int, grid_h: int, grid_w: int, n_tail: int) -> torch.Tensor:
    """[3, T] positions: text, one image of grid_h x grid_w tokens, text again (Qwen2-VL get_rope_index rule)."""
    text = torch.arange(n_text).expand(3, -1)
    hh, ww = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    img = torch.stack([torch.zeros(grid_h * grid_w, dtype=torch.long), hh.flatten(), ww.flatten()]) + n_text
    start = int(img.max()) + 1
    tail = torch.arange(start, start + n_tail).expand(3, -1)
    return torch.cat([text, img, tail], dim=1)


def test_mrope_decoder_matches_hf_qwen2vl_text_model(paged_runner):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel

    cfg = Qwen2VLTextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        initializer_range=0.2,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = Qwen2VLTextModel(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    ours = LlamaDecoderModel(cfg, qkv_bias=True, o_bias=False)
    assert ours.rotary_emb.mrope_section == [2, 3, 3]
    assert ours.load_weights(ref.state_dict().items()) == ours.expected_weight_names()

    pos = _mrope_positions(5, 3, 4, 6)  # T = 23
    T = pos.shape[1]
    embeds = torch.randn(T, 64)
    runner = paged_runner(_HiddenOnly(ours), cfg, block_size=4)
    out = runner.step([("v", [0] * T)], positions={"v": pos}, inputs_embeds={"v": embeds})["v"]
    with torch.no_grad():
        r = ref(inputs_embeds=embeds[None], position_ids=pos[:, None, :], use_cache=True)
    torch.testing.assert_close(out, r.last_hidden_state[0], atol=ATOL, rtol=RTOL)
    past, nxt = r.past_key_values, int(pos.max()) + 1
    for _ in range(2):
        e = torch.randn(1, 64)
        p = torch.full((3, 1), nxt)
        out = runner.step([("v", [0])], positions={"v": p}, inputs_embeds={"v": e})["v"]
        with torch.no_grad():
            r = ref(inputs_embeds=e[None], position_ids=p[:, None, :], past_key_values=past, use_cache=True)
        torch.testing.assert_close(out, r.last_hidden_state[0], atol=ATOL, rtol=RTOL)
        past, nxt = r.past_key_values, nxt + 1


def test_mrope_with_equal_axes_equals_1d_rope():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig

    cfg = Qwen2VLTextConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        max_position_embeddings=64,
    )
    rot = RotaryEmbedding(cfg)
    q, k = torch.randn(10, 4, 16), torch.randn(10, 2, 16)
    pos = torch.arange(3, 13)
    q1, k1, q3, k3 = q.clone(), k.clone(), q.clone(), k.clone()
    rot(pos, q1, k1)
    rot(pos.expand(3, -1).contiguous(), q3, k3)
    torch.testing.assert_close(q1, q3, atol=0, rtol=0)
    torch.testing.assert_close(k1, k3, atol=0, rtol=0)
    assert not torch.equal(q1, q)
