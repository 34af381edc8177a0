"""image_embeds and named (`uuid`) items through the offline engine on a tiny Qwen2-VL with a 4-block tower: the
embeddings the tower gives, sent back as image_embeds, give the image's greedy output, also when the encoder budget
splits items over steps (the tower then never runs for them); a name alone reuses the processed item."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import rand_image
from vlserve import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("media_refs")), vision_depth=4, seed=7)


def _png_url(seed: int, h: int, w: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(rand_image(h, w, seed=seed)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _msg(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare them."}]}]


def _embeds_part(llm: LLM, url: str) -> dict:
    """The image's tower embeddings as an image_embeds part (base64 torch.save, grid as a list)."""
    _, data = llm.input_processor.mm_processor.process_image(url)
    emb = llm.engine.runner.model.embed_multimodal("image", data).cpu()  # [n, H]
    buf = io.BytesIO()
    torch.save(emb, buf)
    value = {
        "image_embeds": base64.b64encode(buf.getvalue()).decode(),
        "image_grid_thw": data["image_grid_thw"].tolist(),
    }
    return {"type": "image_embeds", "image_embeds": value}


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 1])  # 1: one embedding per step, so each item's tower is split
def test_image_embeds_and_names_offline(ckpt, budget):
    kw = {} if budget is None else {"max_num_encoder_input_tokens": budget}
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=256, **kw)
    urls = [_png_url(1, 112, 84), _png_url(2, 56, 112)]
    images = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    ref = llm.chat(_msg(*images), PARAMS, use_tqdm=False)[0]
    runs = llm.engine.get_metrics()["vlserve:encoder_runs_total"]
    parts = [_embeds_part(llm, u) for u in urls]
    out = llm.chat(_msg(*parts), PARAMS, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert llm.engine.get_metrics()["vlserve:encoder_runs_total"] == runs  # the tower did not run for them
    named = [{**images[0], "uuid": "a"}, {**images[1], "uuid": "b"}]
    assert llm.chat(_msg(*named), PARAMS, use_tqdm=False)[0].outputs[0].token_ids == ref.outputs[0].token_ids
    hits = llm.input_processor.mm_processor.cache_hits
    names_only = [{"type": "image_url", "uuid": "a"}, {"type": "image_url", "image_url": None, "uuid": "b"}]
    assert llm.chat(_msg(*names_only), PARAMS, use_tqdm=False)[0].outputs[0].token_ids == ref.outputs[0].token_ids
    assert llm.input_processor.mm_processor.cache_hits == hits + 2
    with pytest.raises(ValueError, match="names no cached item"):
        llm.chat(_msg({"type": "image_url", "uuid": "c"}), PARAMS, use_tqdm=False)
    llm.check_integrity()  # no KV block, encoder-cache entry or partial tower state left
    llm.shutdown()


def test_named_audio_clip(tmp_path):
    from tests.multimodal.audio_media import tones
    from tests.support.audio_checkpoints import build_qwen2_audio_checkpoint
    from vlserve.multimodal.media_refs import NamedItem
    from vlserve.multimodal.processor import MultiModalProcessor

    proc = MultiModalProcessor.from_pretrained(build_qwen2_audio_checkpoint(str(tmp_path)))
    wave = tones(0.5, seed=3)[0]
    content_hash, by_content = proc.process_audio((wave, 16000))
    name_hash, by_name = proc.process_audio(NamedItem("clip", (wave, 16000)))
    assert name_hash != content_hash and torch.equal(by_name["input_features"], by_content["input_features"])
    assert proc.process_audio(NamedItem("clip"))[0] == name_hash  # the name alone: the cached item
    with pytest.raises(ValueError, match="other"):
        proc.process_audio(NamedItem("other"))
