"""A Qwen2-VL image request through the server with its engine in its own process: the processed image (pixel
tensors and hashes) crosses, the text equals the offline engine's, and a repeated image is not encoded again."""

from __future__ import annotations

from tests.api.test_api_media import NO_EOS, VL_ENGINE_KW, data_url, image_msg, offline_vl, png_bytes, vl_ckpt  # noqa: F401
from tests.api.test_engine_process import assert_engine_idle, start_proc_server
from vlserve import SamplingParams


def test_image_request_equals_offline_and_reuses_the_encoder_cache(vl_ckpt, offline_vl):  # noqa: F811
    from vlserve.config import EngineArgs

    msgs = image_msg(data_url(png_bytes(3)))
    ref = offline_vl.chat(msgs, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    served = start_proc_server(EngineArgs(model=vl_ckpt, served_model_name="tiny-vl", **VL_ENGINE_KW))
    try:
        texts = []
        for stream in (False, True):
            kw = dict(model="tiny-vl", messages=msgs, temperature=0, max_tokens=12, extra_body=NO_EOS)
            if stream:
                texts.append(
                    "".join(
                        c.choices[0].delta.content or ""
                        for c in served.client.chat.completions.create(**kw, stream=True)
                        if c.choices
                    )
                )
            else:
                r = served.client.chat.completions.create(**kw)
                assert r.usage.prompt_tokens == len(ref.prompt_token_ids) > 20
                texts.append(r.choices[0].message.content)
        assert texts == [ref.outputs[0].text] * 2
        assert_engine_idle(served)
        m = served.metrics()
        assert m["vlserve:encoder_runs_total"] == 1  # the second request reused the first one's work
    finally:
        served.close()
