"""Per-request media controls on a tiny Qwen2-VL server: media_io_kwargs (video frames), named items (`uuid`) and
precomputed image embeddings (`image_embeds`), with the caches keyed by everything that changes the pixels."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from tests.api.test_api_media import data_url, mp4_bytes, png_bytes
from vlserve.api.errors import APIError
from vlserve.api.media_controls import MediaIOControls
from vlserve.multimodal.hashing import hash_named_item
from vlserve.multimodal.media_refs import NamedItem, decode_image_embeds

ENGINE_KW = dict(
    dtype="float32",
    max_model_len=2048,
    num_kv_blocks=512,
    block_size=16,
    max_num_seqs=8,
    limit_mm_per_prompt={"image": 2, "video": 1},
)
NO_EOS = {"ignore_eos": True}
VIDEO = data_url(mp4_bytes(seed=3, frames=16), "video/mp4")  # 16 frames: 8 and 16 sample differently


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory) -> str:
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("media_controls_vl")))


@pytest.fixture(scope="module")
def served(vl_ckpt):
    from tests.api.conftest import start_server
    from vlserve.api.media import MediaConfig
    from vlserve.config import EngineArgs

    media = MediaConfig(media_io_kwargs={"video": {"num_frames": 4}}, enable_mm_embeds=True)
    s = start_server(EngineArgs(model=vl_ckpt, served_model_name="tiny-vl", **ENGINE_KW), media=media)
    yield s
    s.close()


def video_msg(url: str | None = VIDEO, uuid: str | None = None, text: str = "what happens?") -> list[dict]:
    part: dict = {"type": "video_url", "video_url": None if url is None else {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def image_msg(*parts: dict, before: str = "look", after: str = "describe it") -> list[dict]:
    content = [{"type": "text", "text": before}, *parts, {"type": "text", "text": after}]
    return [{"role": "user", "content": content}]


def image_part(url: str | None, uuid: str | None = None) -> dict:
    part: dict = {"type": "image_url"}
    if url is not None:
        part["image_url"] = {"url": url}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def chat(served, messages, **extra):
    return served.client.chat.completions.create(
        model="tiny-vl", messages=messages, temperature=0, max_tokens=6, extra_body={**NO_EOS, **extra}
    )


def post(served, messages, path="/v1/chat/completions", **body) -> tuple[int, str]:
    payload = {"model": "tiny-vl", "max_tokens": 2, **body}
    if messages is not None:
        payload["messages"] = messages
    r = served.http.post(path, json=payload)
    return r.status_code, (r.json().get("error") or {}).get("message", "") if r.status_code != 200 else ""


def counters(served) -> dict[str, float]:
    m = served.metrics()
    return {k.split(":")[1]: m[k] for k in m if "mm_processor_cache" in k or "encoder_cache_hits_total" in k}


def delta(after: dict, before: dict) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def check_nothing_held(served) -> None:
    m = served.wait_idle()
    assert m["vlserve:kv_cache_usage"] == 0 and m["vlserve:num_requests_running"] == 0
    served.engine.engine.check_integrity()  # no KV block or encoder-cache reference left behind


# -- keys (no server) ------------------------------------------------------------------------------------------------
def test_named_video_key_covers_num_frames(vl_ckpt):
    from vlserve.multimodal.processor import MultiModalProcessor

    proc = MultiModalProcessor.from_pretrained(vl_ckpt)
    frames = np.random.RandomState(0).randint(0, 256, (16, 56, 56, 3), dtype=np.uint8)
    named = NamedItem("clip-1", frames)
    h8, d8 = proc.process_video(named, {}, {"num_frames": 8})
    h16, d16 = proc.process_video(named, {}, {"num_frames": 16})
    assert h8 != h16 and len(proc._cache) == 2  # one entry each: the same name at 8 and 16 frames never shares
    assert int(d8["video_grid_thw"][0, 0]) * 2 == int(d16["video_grid_thw"][0, 0])
    c8, _ = proc.process_video(frames, {}, {"num_frames": 8})
    c16, _ = proc.process_video(frames, {}, {"num_frames": 16})
    assert len({h8, h16, c8, c16}) == 4  # named keys never equal content keys
    assert proc.process_video(NamedItem("clip-1"), {}, {"num_frames": 8})[0] == h8  # the name alone: cached
    with pytest.raises(ValueError, match="clip-1"):
        proc.process_video(NamedItem("clip-1"), {}, {"num_frames": 4})  # never processed at 4 frames
    assert hash_named_item("video", "a", {"fps": 1.0}) != hash_named_item("video", "a", {"fps": 2.0})


def test_media_io_kwargs_merge_rules():
    controls = MediaIOControls({"video": {"fps": 2.0}}, max_frames=32, max_fps=30.0)
    assert controls.merge({"video": {"num_frames": 8}}, None) == {"num_frames": 8, "fps": None}  # drops the default
    assert controls.merge(None, None) == {"num_frames": None, "fps": 2.0}
    assert controls.merge(None, {"num_frames": 6}) == {"num_frames": 6}  # mm_processor_kwargs' own wins
    for value, words in [
        ({"video": {"num_frames": 33}}, "media_io_kwargs.video.num_frames may be at most 32"),
        ({"video": {"fps": 31}}, "media_io_kwargs.video.fps may be at most 30"),
        ({"video": {"num_frames": 0}}, "positive integer"),
        ({"video": {"frames": 3}}, "unsupported key"),
        ({"video": {"num_frames": 4, "fps": 1}}, "not both"),
        ({"image": {"x": 1}}, "media_io_kwargs.image"),
        ({"text": {}}, "unknown modality"),
    ]:
        with pytest.raises(APIError, match=words):
            controls.merge(value, None)
    with pytest.raises(APIError, match="both"):
        controls.merge({"video": {"fps": 1}}, {"num_frames": 4})
    from types import SimpleNamespace

    from vlserve.api.media import MediaConfig

    textless = SimpleNamespace(input_processor=None)  # no media processor: only the fps bound applies
    with pytest.raises(ValueError, match="--media-io-kwargs: media_io_kwargs.video.fps may be at most 30"):
        MediaIOControls.from_engine(textless, MediaConfig(media_io_kwargs={"video": {"fps": 60}}))
    assert MediaIOControls.from_engine(textless, MediaConfig(media_io_kwargs={"video": {"fps": 3}})).defaults
    with pytest.raises(APIError, match="--enable-mm-embeds"):
        MediaIOControls({}).check_parts(image_msg({"type": "image_embeds", "image_embeds": "AAAA"}))


def test_decode_image_embeds_refuses_bad_payloads():
    def b64(obj) -> str:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return base64.b64encode(buf.getvalue()).decode()

    item = decode_image_embeds({"image_embeds": b64(torch.ones(4, 8)), "image_grid_thw": [[1, 4, 4]]})
    assert item.embeds.shape == (4, 8) and item.grid_thw.tolist() == [[1, 4, 4]]
    for value, words in [
        ("!!", "base64"),
        (base64.b64encode(b"junk").decode(), "torch.save"),
        (b64({"a": 1}), "one tensor"),
        (b64(torch.ones(3, dtype=torch.int64)), "float tensor"),
        (b64(torch.full((2, 8), float("nan"))), "NaN"),
        ({"image_embeds": b64(torch.ones(4, 8)), "image_grid_thw": [[1, 0, 4]]}, "positive"),
        ({"image_embeds": b64(torch.ones(4, 8)), "grid": 1}, "unknown key"),
    ]:
        with pytest.raises(ValueError, match=words):
            decode_image_embeds(value)


# -- media_io_kwargs over HTTP ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_video_frames_per_request(served):
    before = counters(served)
    r8 = chat(served, video_msg(), media_io_kwargs={"video": {"num_frames": 8}})
    r16 = chat(served, video_msg(), media_io_kwargs={"video": {"num_frames": 16}})
    default = chat(served, video_msg())  # the server's --media-io-kwargs: 4 frames
    assert default.usage.prompt_tokens < r8.usage.prompt_tokens < r16.usage.prompt_tokens
    d = delta(counters(served), before)
    assert d["mm_processor_cache_misses_total"] == 3 and d["mm_processor_cache_hits_total"] == 0
    again = chat(served, video_msg(), media_io_kwargs={"video": {"num_frames": 8}})
    assert again.usage.prompt_tokens == r8.usage.prompt_tokens and again.choices[0].message.content == (
        r8.choices[0].message.content
    )
    assert delta(counters(served), before)["mm_processor_cache_hits_total"] == 1
    # the same frames through mm_processor_kwargs: the same key, so a hit too
    chat(served, video_msg(), mm_processor_kwargs={"num_frames": 8})
    assert delta(counters(served), before)["mm_processor_cache_hits_total"] == 2
    check_nothing_held(served)


@pytest.mark.slow
def test_media_io_kwargs_refusals(served):
    cases = [
        ({"video": {"num_frames": 100000}}, "media_io_kwargs.video.num_frames may be at most"),
        ({"video": {"fps": 1000}}, "media_io_kwargs.video.fps may be at most"),
        ({"video": {"frames": 2}}, "unsupported key"),
        ({"audio": {"x": 1}}, "media_io_kwargs.audio"),
    ]
    for value, words in cases:
        for path, messages in (("/v1/chat/completions", video_msg()), ("/v1/completions", None)):
            extra = {"prompt": "hi"} if messages is None else {}
            status, msg = post(served, messages, path, media_io_kwargs=value, **extra)
            assert status == 400 and words in msg, (path, value, msg)
    status, msg = post(
        served, video_msg(), media_io_kwargs={"video": {"fps": 1}}, mm_processor_kwargs={"num_frames": 2}
    )
    assert status == 400 and "both" in msg
    status, _ = post(served, None, "/v1/completions", prompt="hi", media_io_kwargs={"video": {"num_frames": 2}})
    assert status == 200
    check_nothing_held(served)


# -- uuid ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_uuid_reuse_hits_the_caches(served):
    url = data_url(png_bytes(21, size=(84, 84)))
    original = chat(served, image_msg(image_part(url, "img-21")))
    before = counters(served)
    reused = chat(served, image_msg(image_part(None, "img-21")))
    assert reused.choices[0].message.content == original.choices[0].message.content
    assert reused.usage.prompt_tokens == original.usage.prompt_tokens
    assert delta(counters(served), before)["mm_processor_cache_hits_total"] == 1
    # text before the image differs: no prefix-cache hit covers it, the encoder cache serves the embeddings
    before = counters(served)
    named = chat(served, image_msg({"type": "image_url", "image_url": None, "uuid": "img-21"}, before="again"))
    d = delta(counters(served), before)
    assert d["mm_processor_cache_hits_total"] == 1 and d["encoder_cache_hits_total"] == 1
    by_content = chat(served, image_msg(image_part(url), before="again"))
    assert named.choices[0].message.content == by_content.choices[0].message.content
    # a video named at 8 frames is not the one at 4 (the server's default)
    chat(served, video_msg(uuid="clip-21"), media_io_kwargs={"video": {"num_frames": 8}})
    assert chat(served, video_msg(None, uuid="clip-21"), media_io_kwargs={"video": {"num_frames": 8}}).choices
    status, msg = post(served, video_msg(None, uuid="clip-21"))
    assert status == 400 and "clip-21" in msg
    check_nothing_held(served)


@pytest.mark.slow
def test_unknown_uuid_is_refused(served):
    status, msg = post(served, image_msg(image_part(None, "never-sent")))
    assert status == 400 and "never-sent" in msg and "no cached item" in msg
    status, msg = post(served, image_msg(image_part(None, "")))
    assert status == 400 and "uuid" in msg
    assert served.http.get("/health").status_code == 200
    check_nothing_held(served)


# -- image_embeds ----------------------------------------------------------------------------------------------------
def _tower_embeds(served, url: str) -> tuple[torch.Tensor, list]:
    """The image's embeddings as the server's own vision tower computes them, and its grid."""
    proc = served.engine.input_processor.mm_processor
    _, data = proc.process_image(url)
    emb = served.engine.engine.runner.model.embed_multimodal("image", data)  # [n, H]
    return emb.detach().cpu(), data["image_grid_thw"].tolist()


def _embeds_part(emb: torch.Tensor, grid: list | None) -> dict:
    buf = io.BytesIO()
    torch.save(emb, buf)
    payload = base64.b64encode(buf.getvalue()).decode()
    value = payload if grid is None else {"image_embeds": payload, "image_grid_thw": grid}
    return {"type": "image_embeds", "image_embeds": value}


@pytest.mark.slow
def test_image_embeds_equal_the_image(served):
    urls = [data_url(png_bytes(31, size=(84, 84))), data_url(png_bytes(32, size=(56, 112)))]
    towers = [_tower_embeds(served, u) for u in urls]
    by_image = chat(served, image_msg(*[image_part(u) for u in urls]))
    by_embeds = chat(served, image_msg(*[_embeds_part(e, g) for e, g in towers]))
    assert by_embeds.choices[0].message.content == by_image.choices[0].message.content
    assert by_embeds.usage.prompt_tokens == by_image.usage.prompt_tokens
    mixed = chat(served, image_msg(_embeds_part(*towers[0]), image_part(urls[1])))
    assert mixed.choices[0].message.content == by_image.choices[0].message.content
    check_nothing_held(served)


@pytest.mark.slow
def test_image_embeds_bad_shapes(served):
    emb, grid = _tower_embeds(served, data_url(png_bytes(33)))
    n, hidden = emb.shape
    cases = [
        (_embeds_part(torch.zeros(n, hidden + 1), grid), "hidden size"),
        (_embeds_part(emb[: n - 1], grid), "image_grid_thw"),
        (_embeds_part(emb, [[1, grid[0][1] + 1, grid[0][2]]]), "image_grid_thw"),
        (_embeds_part(emb, None), "needs image_grid_thw"),
        ({"type": "image_embeds", "image_embeds": "not base64!"}, "base64"),
        ({"type": "image_embeds", "image_embeds": {"image_embeds": "AAAA"}, "uuid": "x"}, "uuid"),
    ]
    for part, words in cases:
        status, msg = post(served, image_msg(part))
        assert status == 400 and words in msg, (words, msg)
    check_nothing_held(served)


# -- `vlserve serve` (engine in its own process, the flags from the command line) -------------------------------------
@pytest.mark.slow
def test_serve_flags_through_the_engine_process(vl_ckpt, repo_root):
    import json

    import httpx

    from tests.api.conftest import serve_subprocess
    from vlserve import LLM

    llm = LLM(vl_ckpt, dtype="float32", num_kv_blocks=64)
    url = data_url(png_bytes(41, size=(84, 84)))
    _, data = llm.input_processor.mm_processor.process_image(url)
    emb = llm.engine.runner.model.embed_multimodal("image", data).cpu()  # [n, H]: the tower's
    grid = data["image_grid_thw"].tolist()
    llm.shutdown()
    flags = [vl_ckpt, "--dtype", "float32", "--num-kv-blocks", "256", "--served-model-name", "tiny-vl"]
    flags += ["--media-io-kwargs", json.dumps({"video": {"num_frames": 4}}), "--enable-mm-embeds"]
    with serve_subprocess(flags, repo_root, 180) as base, httpx.Client(base_url=base, timeout=120) as http:

        def ask(messages, **extra) -> dict:
            body = {"model": "tiny-vl", "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r = http.post("/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 200, r.text
            return r.json()

        by_image = ask(image_msg(image_part(url, "img-41")))
        by_embeds = ask(image_msg(_embeds_part(emb, grid)))
        by_name = ask(image_msg(image_part(None, "img-41")))
        texts = {r["choices"][0]["message"]["content"] for r in (by_image, by_embeds, by_name)}
        assert len(texts) == 1 and by_embeds["usage"]["prompt_tokens"] == by_image["usage"]["prompt_tokens"]
        four = ask(video_msg())["usage"]["prompt_tokens"]
        eight = ask(video_msg(), media_io_kwargs={"video": {"num_frames": 8}})["usage"]["prompt_tokens"]
        assert four < eight
        r = http.post("/v1/chat/completions", json={"model": "tiny-vl", "messages": image_msg(image_part(None, "x"))})
        assert r.status_code == 400 and "no cached item" in r.json()["error"]["message"]
