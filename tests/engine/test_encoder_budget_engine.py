"""The per-step encoder budget through the engine, on the demo Qwen2-VL: a burst of images is encoded a few at a
time (at a tiny budget, a block of one image's tower per step) while a running text stream keeps producing a token
every step, and greedy outputs do not depend on it."""

import pytest
from PIL import Image

from tests.multimodal.mm_media import rand_image
from vlserve import LLM, SamplingParams
from vlserve.engine.engine_loop import NewRequest

NUM_IMAGES = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _burst(**engine_kwargs):
    """A text request runs one step, then NUM_IMAGES image requests arrive at once. Returns (per step after the
    burst: (items encoded, tokens the text request got), final token ids per request, the LLM)."""
    llm = LLM(num_kv_blocks=256, **engine_kwargs)  # no model: the demo
    loop, ip, runner = llm.engine_loop, llm.input_processor, llm.engine.runner
    loop.add_requests([NewRequest("text", ip.process_prompt("Tell me about the shapes."), PARAMS, 0.0)])
    loop.step()
    images = [Image.fromarray(rand_image(112, 112, seed=i)) for i in range(NUM_IMAGES)]
    loop.add_requests(
        [
            NewRequest(f"img{i}", ip.process_prompt("Describe the picture.", images=[img]), PARAMS, 0.0)
            for i, img in enumerate(images)
        ]
    )
    steps, tokens, text_len = [], {}, 1
    while loop.has_unfinished_requests():
        runs = runner.encoders.counters().num_runs
        outs = {o.request_id: o for o in loop.step()}
        text = outs.get("text")
        new_text = len(text.outputs[0].token_ids) - text_len if text is not None else 0
        text_len += new_text
        steps.append((runner.encoders.counters().num_runs - runs, new_text))
        tokens.update({rid: o.outputs[0].token_ids for rid, o in outs.items() if o.finished})
    assert runner.encoders.counters().num_runs == NUM_IMAGES
    llm.check_integrity()  # no KV block, encoder-cache reference or runner state left
    return steps, tokens, llm


def test_small_budget_encodes_one_tower_block_per_step_while_text_decodes():
    small, small_tokens, llm = _burst(max_num_encoder_input_tokens=1)
    depth = llm.engine.scheduler_config.encoder_stage_counts["image"]  # the demo tower's blocks: its stages
    assert depth > 1
    # one block of one image per step: an image is done every `depth` steps
    assert [n for n, _ in small[: NUM_IMAGES * depth]] == ([0] * (depth - 1) + [1]) * NUM_IMAGES
    left = PARAMS.max_tokens - 1  # the text stream's tokens after the burst arrived: one in each step until done
    assert [t for _, t in small[:left]] == [1] * left and left <= NUM_IMAGES * depth
    big, big_tokens, _ = _burst(max_num_encoder_input_tokens=100_000)
    assert big[0][0] == NUM_IMAGES  # the whole burst in one step
    assert small_tokens == big_tokens and len(small_tokens) == NUM_IMAGES + 1


def test_default_budget_is_measured_and_changes_no_output():
    _, fixed_tokens, _ = _burst(max_num_encoder_input_tokens=1)
    steps, tokens, llm = _burst()
    assert tokens == fixed_tokens
    budget = llm.engine.encoder_budget
    assert budget.fixed is None and budget.seconds_per_embed > 0 and budget.decode_step_seconds > 0
    assert steps[0][0] == 0  # the first burst step: nothing measured yet (budget 1), so one block of one image
    assert llm.engine.scheduler.encoder_budget == budget.budget >= 1


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_bad_max_num_encoder_input_tokens_refused(value):
    from vlserve.config import EngineArgs

    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        EngineArgs(max_num_encoder_input_tokens=value)
