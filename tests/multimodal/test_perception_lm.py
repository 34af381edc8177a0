"""PerceptionLM with a timm-built vision tower: greedy parity with HF generate through LLM.generate, LLM.chat and
the server; chunked prefill and preemption; placeholder counts as HF's processor computes them; the encoder cache."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.multimodal.mm_media import rand_image
from tests.support.hf_oracle import HFImageTextOracle, data_url
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

MAX_NEW = 8
# (height, width): thumbnail + 4, + 3 and + 1 tiles with max_num_tiles=4, and an extreme aspect ratio
SIZES = [(60, 100), (50, 150), (40, 44), (20, 300)]


@pytest.fixture(scope="module")
def plm_dir(tmp_path_factory):
    from tests.support.plm_checkpoints import build_plm_checkpoint

    return build_plm_checkpoint(str(tmp_path_factory.mktemp("plm")))


class PLMOracle(HFImageTextOracle):
    """HF AutoProcessor + AutoModelForImageTextToText greedy generate on the same checkpoint (float32)."""

    def __init__(self, model_dir: str):
        super().__init__(model_dir, MAX_NEW, vlserve_processor=False)


@pytest.fixture(scope="module")
def oracle(plm_dir):
    return PLMOracle(plm_dir)


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _images():
    return [Image.fromarray(rand_image(h, w, seed=i)) for i, (h, w) in enumerate(SIZES)]


def _cases(oracle):
    a, b, c, d = _images()
    return [
        ("wide", oracle.text(1, "What is this?"), [a]),
        ("3:1", oracle.text(1, "What is this?"), [b]),
        ("small", oracle.text(1, "Describe it."), [c]),
        ("two images", oracle.text(2, "Compare them."), [d, a]),
        ("text only", oracle.text(0, "Hello there"), []),
    ]


def _run(llm, cases, **kw):
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} for _, text, imgs in cases]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False, **kw)]


@pytest.fixture(scope="module")
def expected(oracle):
    return [oracle.greedy(text, imgs) for _, text, imgs in _cases(oracle)]


def test_placeholder_counts_match_hf_processor(plm_dir, oracle):
    from vlserve.multimodal.processor import MultiModalProcessor

    proc = MultiModalProcessor.from_pretrained(plm_dir)
    tok_ids = proc.tokenizer(oracle.text(1, "x"), add_special_tokens=False)["input_ids"]
    counts = set()
    for img in _images():
        for kwargs in ({}, {"max_num_tiles": 1}, {"vision_input_type": "vanilla"}):
            ids, feats = proc.process(tok_ids, [img], mm_processor_kwargs=kwargs)
            # nested: 4.57's processor drops top-level image kwargs it does not list
            hf_ids = oracle.inputs(oracle.text(1, "x"), [img], images_kwargs=kwargs)["input_ids"][0].tolist()
            assert ids == hf_ids, (img.size, kwargs)
            assert feats[0].length == ids.count(proc.image_token_id) <= proc.max_image_embeds(kwargs)
            counts.add(feats[0].length)
    assert len(counts) >= 3, counts  # sizes, aspect ratios and tiling settings change the count


def test_generate_and_chat_parity_with_hf(plm_dir, oracle, expected):
    llm = LLM(plm_dir, dtype="float32", num_kv_blocks=128)
    cases = _cases(oracle)
    got = _run(llm, cases)
    for (name, *_), g, e in zip(cases, got, expected):
        assert g == e, f"{name}: {g} vs HF {e}"
    assert expected[0] != expected[1], "different images must give different outputs"
    # images= on a plain prompt (wrapped in the chat template) and an OpenAI image_url part
    _, text, imgs = cases[0]
    wrapped = llm.generate("What is this?", _greedy(), images=[imgs], use_tqdm=False)
    assert wrapped[0].outputs[0].token_ids == expected[0]
    url = data_url(imgs[0])
    chat = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
        _greedy(),
        use_tqdm=False,
    )
    assert chat[0].outputs[0].token_ids == expected[0]
    llm.check_integrity()


@pytest.mark.slow
def test_chunked_prefill_32_with_forced_preemption(plm_dir, oracle, expected):
    # 32-token steps split every image's placeholder run; 8 blocks x 16 slots cannot hold the batch at once.
    llm = LLM(
        plm_dir, dtype="float32", num_kv_blocks=8, block_size=16, max_num_batched_tokens=32, enable_prefix_caching=False
    )
    assert _run(llm, _cases(oracle)) == expected
    m = llm.get_metrics()
    assert m["vlserve:num_preemptions_total"] > 0
    llm.check_integrity()


def test_one_image_in_eight_requests_encodes_once(plm_dir):
    llm = LLM(plm_dir, dtype="float32", num_kv_blocks=128)
    img = Image.fromarray(rand_image(60, 100, seed=11))
    outs = llm.generate([f"Question {i}?" for i in range(8)], _greedy(3), images=[[img]] * 8, use_tqdm=False)
    assert len(outs) == 8
    m = llm.get_metrics()
    assert m["vlserve:encoder_runs_total"] == 1
    assert m["vlserve:mm_processor_cache_hits_total"] == 7
    llm.check_integrity()


def test_bad_tiling_kwargs_rejected_and_engine_continues(plm_dir):
    llm = LLM(plm_dir, dtype="float32", num_kv_blocks=64, limit_mm_per_prompt={"image": 1})
    img = rand_image(30, 30)
    with pytest.raises(ValueError, match="tile_size"):
        llm.generate("Look.", _greedy(2), images=[[img]], mm_processor_kwargs={"tile_size": 64}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_num_tiles"):
        llm.generate("Look.", _greedy(2), images=[[img]], mm_processor_kwargs={"max_num_tiles": 10**6}, use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llm.generate("Two.", _greedy(2), images=[[img, img]], use_tqdm=False)
    with pytest.raises(ValueError, match="video"):
        llm.generate("Clip.", _greedy(2), videos=[[rand_image(30, 30)[None].repeat(2, 0)]], use_tqdm=False)
    llm.check_integrity()
    assert len(llm.generate("Look.", _greedy(2), images=[[img]], use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_server_image_url_parity_with_hf(plm_dir, oracle, expected):
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs

    _, text, imgs = _cases(oracle)[0]
    url = data_url(imgs[0])
    served = start_server(
        EngineArgs(
            model=plm_dir, served_model_name="tiny-plm", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=32
        )
    )
    try:
        r = served.client.chat.completions.create(
            model="tiny-plm",
            temperature=0,
            max_tokens=MAX_NEW,
            extra_body={"ignore_eos": True},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "What is this?"},
                    ],
                }
            ],
        )
        tok = oracle.processor.tokenizer
        assert r.choices[0].message.content == tok.decode(expected[0], skip_special_tokens=True)
        assert r.usage.prompt_tokens == oracle.inputs(text, imgs)["input_ids"].shape[1]
        assert r.usage.completion_tokens == MAX_NEW
        served.wait_idle()
    finally:
        served.close()
