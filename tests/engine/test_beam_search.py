"""Beam search (vlserve.beam_search, `LLM.beam_search`): the beams equal HF generate's beam search token for token,
in order, on text and image prompts (k = 2, 4, EOS ignored); the ranking rules on hand-made logprobs; bad input; the
prompt's blocks and image shared by all beams and steps."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import rand_image
from tests.support.hf_generate import hf_beam_search_ignoring_eos
from tests.support.hf_oracle import data_url
from vlserve import LLM, BeamSearchParams
from vlserve.beam_search import BeamSearch, BeamSearchSequence, beam_score

MAX_NEW = 8


# -- the algorithm on hand-made logprobs ----------------------------------------------------------------------------
def test_candidates_of_all_beams_are_ranked_together():
    s = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3), eos_token_ids=(0,))
    assert s.step_params().logprobs == 4 and s.step_params().max_tokens == 1
    s.advance([{5: -0.1, 6: -0.5, 7: -2.0}])
    assert [b.tokens for b in s.live] == [[1, 2, 5], [1, 2, 6]]
    s.advance([{8: -3.0, 9: -4.0}, {10: -0.2, 11: -0.3}])  # both survivors come from the second beam
    assert [b.output_tokens for b in s.live] == [[6, 10], [6, 11]]
    assert s.live[0].cum_logprob == pytest.approx(-0.7)


def test_eos_beams_finish_and_are_ranked_by_length_penalised_score():
    p = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=1.0)
    s = BeamSearch([1, 2], p, eos_token_ids=(0,))
    s.advance([{0: -0.3, 5: -0.4, 6: -0.5}])  # EOS is the best token: that beam finishes
    assert [b.output_tokens for b in s.completed] == [[0]] and len(s.live) == 2
    while not s.done:
        s.advance([{7: -1.0, 8: -1.5} for _ in s.live])
    best = s.best()
    assert best[0].output_tokens == [0] and best[0].finished  # -0.3 over 2 tokens (EOS not counted)
    scores = [beam_score(b, (0,), 1.0) for b in best]
    assert scores == sorted(scores, reverse=True)
    ignoring = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True), (0,))
    ignoring.advance([{0: -0.3, 5: -0.4}])
    assert not ignoring.completed and [b.output_tokens for b in ignoring.live] == [[0], [5]]


def test_length_penalty_and_early_stopping():
    long = BeamSearchSequence([1, 2, 3, 4, 5, 6], -3.0, 2)
    short = BeamSearchSequence([1, 2, 3], -2.0, 2)
    assert beam_score(long, (), 1.0) > beam_score(short, (), 1.0)  # -0.5 vs -0.667
    assert beam_score(long, (), 0.0) < beam_score(short, (), 0.0)  # plain sums
    s = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=10, early_stopping=True), (0,))
    s.advance([{0: -0.1, 4: -0.2}])
    assert s.done and s.num_steps == 1


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=33, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature"),
    ],
)
def test_bad_params_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**bad)


# -- against HF -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("beam_text")), arch="llama")


@pytest.mark.hf_parity
@pytest.mark.parametrize("k", [2, 4])
def test_text_beams_equal_hf(text_dir, k):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 23)]
    llm = LLM(text_dir, dtype="float32", num_kv_blocks=256, block_size=16)
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=k, max_tokens=MAX_NEW, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        want = hf_beam_search_ignoring_eos(hf, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, k, MAX_NEW)
        assert [b.output_tokens for b in out.sequences] == want
        assert all(b.tokens[: len(prompt)] == prompt for b in out.sequences)
        cums = [b.cum_logprob for b in out.sequences]
        assert cums == sorted(cums, reverse=True) and len(set(map(tuple, want))) == k
    assert llm.get_metrics()["vlserve:prefix_cache_hits_total"] > 0  # later steps reuse the prompt's blocks
    llm.check_integrity()


def test_prompt_plus_max_tokens_past_the_model_length_is_refused(text_dir):
    llm = LLM(text_dir, dtype="float32", num_kv_blocks=64, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([list(range(3, 30))], BeamSearchParams(beam_width=2, max_tokens=8))
    llm.check_integrity()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    from vlserve.demo.llava_checkpoints import build_llava_checkpoint

    return build_llava_checkpoint(
        str(tmp_path_factory.mktemp("beam_llava") / "m"), variant="llava", tower="clip", text_model="llama"
    )


@pytest.mark.hf_parity
@pytest.mark.parametrize("k", [2, 4])
def test_image_beams_equal_hf_and_encode_once(llava_dir, k):
    from transformers import AutoModelForImageTextToText

    from vlserve.multimodal.processor import load_hf_processor

    img = Image.fromarray(rand_image(40, 60, seed=k))
    llm = LLM(llava_dir, dtype="float32", num_kv_blocks=256)
    conversation = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(img)}},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]
    out = llm.beam_search(conversation, BeamSearchParams(beam_width=k, max_tokens=MAX_NEW, ignore_eos=True))[0]
    processor = load_hf_processor(llava_dir)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = processor(text=[text], images=[img], return_tensors="pt")
    inputs.pop("token_type_ids", None)
    hf = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32).eval()
    assert out.sequences[0].tokens[: inputs["input_ids"].shape[1]] == inputs["input_ids"][0].tolist()
    assert [b.output_tokens for b in out.sequences] == hf_beam_search_ignoring_eos(hf, inputs, k, MAX_NEW)
    assert llm.get_metrics()["vlserve:encoder_runs_total"] == 1  # every beam of every step reused the image
    assert out.sequences[0].text.endswith(llm.tokenizer.decode(out.sequences[0].output_tokens))
    llm.check_integrity()
