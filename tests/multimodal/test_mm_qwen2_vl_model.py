"""Qwen2-VL / Qwen2.5-VL model parity with HF transformers: vision tower, chunked prefill with an image and a video
over a paged KV cache, greedy decode with M-RoPE deltas, both checkpoint layouts."""

from __future__ import annotations

import random

import pytest
import torch
from mm_media import rand_image, rand_video

from tests.support.hf_generate import align_hf_video_inputs
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.multimodal.embeds import merge_mm_embeds, slice_mm_embeds
from vlserve.multimodal.mrope import decode_mrope_positions, get_mrope_positions
from vlserve.multimodal.processor import MultiModalProcessor

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

ATOL = RTOL = 2e-4
NEW_TOKENS = 5
PROMPT = (
    "<|im_start|>user\nlook <|vision_start|><|image_pad|><|vision_end|> and then "
    "<|vision_start|><|video_pad|><|vision_end|> what moves?<|im_end|>\n<|im_start|>assistant\n"
)


class PagedSequence:
    """One sequence over a per-layer paged KV cache (block size 4, scrambled block ids)."""

    def __init__(self, model, text_cfg, num_blocks: int = 96, block_size: int = 4):
        head_dim = text_cfg.hidden_size // text_cfg.num_attention_heads
        shape = (num_blocks, block_size, text_cfg.num_key_value_heads, head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(text_cfg.num_hidden_layers)]
        self.blocks = random.Random(0).sample(range(num_blocks), num_blocks)
        self.model, self.bs, self.len = model, block_size, 0

    def step(self, positions: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """positions [3, q], embeds [q, H] -> logits [q, V]."""
        q, start = embeds.shape[0], self.len
        end, bs = start + q, self.bs
        slots = [self.blocks[i // bs] * bs + i % bs for i in range(start, end)]
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor([0, q], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=torch.tensor([self.blocks[: -(-end // bs)]], dtype=torch.int32),
            num_decodes=int(q == 1 and start > 0),
            max_query_len=q,
            max_seq_len=end,
            query_start_loc_cpu=[0, q],
            seq_lens_cpu=[end],
        )
        self.len = end
        with torch.inference_mode():
            return self.model.compute_logits(self.model(None, positions, self.kv, md, inputs_embeds=embeds))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def setup(request):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    import vlserve.models.qwen2_vl  # noqa: F401  (registers the architectures)
    from vlserve.models import load_model

    d = request.getfixturevalue(f"{request.param}_dir")
    cfg = AutoConfig.from_pretrained(d)
    ours = load_model(d, cfg, torch.float32, "cpu")
    ref = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    hf_proc = AutoProcessor.from_pretrained(d)
    return d, cfg, ours, ref, hf_proc


def test_registered_and_loaded(setup):
    from vlserve.models import get_model_class

    d, cfg, ours, _, _ = setup
    assert get_model_class(cfg) is type(ours)
    assert type(ours).__name__ == cfg.architectures[0]


def _first_item_features(out) -> torch.Tensor:
    """The first item's merged embeddings from HF get_image/video_features: 4.x returns the per-item tensors,
    5.x an output object whose pooler_output holds them."""
    return getattr(out, "pooler_output", out)[0]


def test_vision_tower_matches_hf(setup):
    _, _, ours, ref, hf_proc = setup
    proc = MultiModalProcessor(hf_proc)
    _, (img, vid) = proc.process(
        hf_proc.tokenizer(PROMPT).input_ids, images=[rand_image(70, 110, 1)], videos=[rand_video(4, 56, 84, 2)]
    )
    with torch.no_grad():
        ref_img = _first_item_features(
            ref.model.get_image_features(img.data["pixel_values"], img.data["image_grid_thw"])
        )
        ref_vid = _first_item_features(
            ref.model.get_video_features(vid.data["pixel_values_videos"], vid.data["video_grid_thw"])
        )
    e_img, e_vid = ours.embed_multimodal("image", img.data), ours.embed_multimodal("video", vid.data)
    assert e_img.shape == (img.length, ours.text_config.hidden_size) and e_vid.shape[0] == vid.length
    torch.testing.assert_close(e_img, ref_img, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e_vid, ref_vid, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not 'audio'"):
        ours.embed_multimodal("audio", {})


def test_chunked_prefill_and_decode_match_hf(setup):
    from transformers import GenerationConfig

    _, cfg, ours, ref, hf_proc = setup
    image, video = rand_image(70, 110, 3), rand_video(4, 56, 140, 4)
    proc = MultiModalProcessor(hf_proc)
    ids, feats = proc.process(
        hf_proc.tokenizer(PROMPT).input_ids, images=[image], videos=[video], mm_processor_kwargs={"fps": 1.0}
    )
    inputs = hf_proc(text=[PROMPT], images=[image], videos=[video], fps=1.0, return_tensors="pt")
    skip = align_hf_video_inputs(inputs, 1.0, ref.config)
    if skip:
        pytest.skip(skip)
    assert ids == inputs["input_ids"][0].tolist()
    ref.generation_config.eos_token_id = None  # 5.x fills an unset eos_token_id from the model's config
    gen_cfg = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        full = ref(**inputs).logits[0]  # [L, V]
        gen = ref.generate(**inputs, generation_config=gen_cfg)
    hf_tokens = gen.sequences[0, len(ids) :].tolist()

    positions, delta = get_mrope_positions(ids, feats, cfg)
    encoder_outputs = {f.mm_hash: ours.embed_multimodal(f.modality, f.data) for f in feats}
    seq = PagedSequence(ours, ours.text_config)
    # Three prefill chunks; the first boundary cuts the image, the second the video.
    cuts = [0, feats[0].offset + 3, feats[1].offset + feats[1].length // 2, len(ids)]
    for s, e in zip(cuts, cuts[1:]):
        embeds = merge_mm_embeds(
            ours.get_input_embeddings(torch.tensor(ids[s:e])), slice_mm_embeds(feats, encoder_outputs, s, e)
        )
        logits = seq.step(positions[:, s:e], embeds)
        torch.testing.assert_close(logits, full[s:e], atol=ATOL, rtol=RTOL)
    tokens = [int(logits[-1].argmax())]
    for i in range(1, NEW_TOKENS):
        torch.testing.assert_close(logits[-1], gen.logits[i - 1][0], atol=ATOL, rtol=RTOL)
        pos = decode_mrope_positions(delta, seq.len, seq.len + 1)  # [3, 1]
        logits = seq.step(pos, ours.get_input_embeddings(torch.tensor([tokens[-1]])))
        tokens.append(int(logits[-1].argmax()))
    assert tokens == hf_tokens
    assert len(set(tokens)) > 1  # the random model is lively


def test_new_checkpoint_layout_and_errors(setup):
    from vlserve.models.loader import iter_safetensors_weights

    d, cfg, ours, _, _ = setup
    fresh = type(ours)(cfg).eval()

    def renamed():
        for name, t in iter_safetensors_weights(d):
            if name.startswith("visual."):
                name = "model." + name
            elif name.startswith("model."):
                name = "model.language_model." + name[len("model.") :]
            yield name, t

    fresh.load_weights(renamed())
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), fresh.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    with pytest.raises(ValueError, match="missing"):
        type(ours)(cfg).load_weights((n, t) for n, t in iter_safetensors_weights(d) if "merger" not in n)
    with pytest.raises(ValueError, match="unexpected"):
        type(ours)(cfg).load_weights([("visual.nonsense.weight", torch.zeros(1))])
