"""InternVL3 video over the OpenAI server: a short synthetic clip, encoded as mp4 and sent as a `video_url` data URL,
gives HF's greedy text for the same frames. The reference is HF generate itself (InternVLProcessor takes the raw
frames with do_sample_frames=False, as in test_internvl.py): the frames are the mp4 decoded by
vlserve.multimodal.media.load_video, which is what the server does with the URL (all frames kept, no sampling)."""

from __future__ import annotations

import base64

import pytest

from tests.multimodal.mm_media import encode_video, rand_video
from tests.multimodal.test_internvl import MAX_NEW, InternVLOracle

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)


@pytest.fixture(scope="module")
def ivl_dir(tmp_path_factory):
    from tests.support.internvl_checkpoints import build_internvl_checkpoint

    return build_internvl_checkpoint(str(tmp_path_factory.mktemp("internvl_video_server")))


@pytest.fixture(scope="module")
def oracle(ivl_dir):
    return InternVLOracle(ivl_dir)


def test_server_video_url_parity_with_hf(ivl_dir, oracle):
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs
    from vlserve.multimodal.media import load_video

    clip = encode_video(rand_video(4, 40, 50, seed=21), fps=4)  # mpeg4 is lossy: compare on the decoded frames
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    frames = load_video(clip).frames
    assert frames.shape == (4, 40, 50, 3)
    text = oracle.text(0, "What happens?", n_videos=1)
    hf_prompt, hf_new = oracle.run(text, [], [frames])
    served = start_server(
        EngineArgs(
            model=ivl_dir,
            served_model_name="tiny-internvl",
            dtype="float32",
            num_kv_blocks=128,
            max_num_batched_tokens=16,
        )
    )
    try:
        r = served.client.chat.completions.create(
            model="tiny-internvl",
            temperature=0,
            max_tokens=MAX_NEW,
            extra_body={"ignore_eos": True},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": url}},
                        {"type": "text", "text": "What happens?"},
                    ],
                }
            ],
        )
        tok = oracle.processor.tokenizer
        # a stream ending inside a UTF-8 sequence holds that partial character back
        want = tok.decode(hf_new, skip_special_tokens=True).rstrip("\ufffd")
        assert r.choices[0].message.content.rstrip("\ufffd") == want and want
        assert r.usage.prompt_tokens == len(hf_prompt)  # four `FrameN: <img>...</img>` lines
        assert r.usage.completion_tokens == MAX_NEW
        served.wait_idle()
        assert (
            served.metrics_labelled()['vlserve:encoder_runs_by_modality_total{modality="video"}'] == 4
        )  # a frame each
    finally:
        served.close()
