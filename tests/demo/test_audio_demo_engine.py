"""vlserve serving the shipped audio demo (`vlserve-demo-audio`): the same answers as HF generate on held-out clips,
and the clip-length limit that the checkpoint's 5-second feature window sets by default."""

import numpy as np
import pytest

from training.eval_audio import evaluate, messages_for
from vlserve import LLM, SamplingParams


@pytest.mark.slow
@pytest.mark.hf_parity
def test_demo_audio_answers_equal_hf_generate():
    acc = evaluate(engine="both", per_form=4, show_errors=0, threads=1)
    assert acc["hf_agreement"] == 1.0
    assert acc["overall"] >= 0.6  # a trained model; a broken audio path answers nothing right


def test_demo_audio_refuses_clips_longer_than_its_window():
    llm = LLM(model="vlserve-demo-audio")
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    long_clip = {"audio": np.zeros(6 * 16000, np.float32), "question": "How many beeps are there?"}
    with pytest.raises(ValueError, match="5 s"):
        llm.chat([messages_for(long_clip, "vlserve")], sp, use_tqdm=False)
    ok_clip = {"audio": np.zeros(4 * 16000, np.float32), "question": "How many beeps are there?"}
    out = llm.chat([messages_for(ok_clip, "vlserve")], sp, use_tqdm=False)
    assert out[0].outputs[0].token_ids
    llm.engine_loop.core.check_integrity()  # no KV block or encoder-cache reference left behind
