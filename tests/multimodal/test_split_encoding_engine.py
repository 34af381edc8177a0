"""Split encoding through the engine on tiny Qwen2-VL / Qwen2.5-VL checkpoints with a 4-block tower: with a forced
encoder budget of one embedding each image's tower runs one block per step, a running text stream gets a token in
every one of those steps, greedy outputs equal the unsplit run's, and an abort mid-encode leaves nothing behind."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.multimodal.mm_media import rand_image
from vlserve import LLM, SamplingParams
from vlserve.engine.engine_loop import NewRequest

DEPTH = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TEXT_PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def deep_tower_dir(request, tmp_path_factory):
    """Qwen2.5-VL: windowed blocks 0, 2, 3 and a full-attention block 1 (both kinds cross a slice boundary)."""
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(
        str(tmp_path_factory.mktemp(request.param)),
        variant=request.param,
        vision_depth=DEPTH,
        fullatt_block_indexes=(1,),
        seed=5,
    )


def _images():
    return [Image.fromarray(rand_image(112, 84, seed=1)), Image.fromarray(rand_image(56, 112, seed=2))]


def _run(model_dir: str, budget: int, **engine_kwargs):
    """A text request runs one step, then two image requests arrive (one image each, then both images in one).
    Returns (per step after they arrived: (slices run, tokens the text request got), final tokens per request)."""
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256, max_num_encoder_input_tokens=budget, **engine_kwargs)
    loop, ip = llm.engine_loop, llm.input_processor
    loop.add_requests([NewRequest("text", ip.process_prompt("Count to ten."), TEXT_PARAMS, 0.0)])
    loop.step()
    img_a, img_b = _images()
    loop.add_requests(
        [
            NewRequest("a", ip.process_prompt("Describe it.", images=[img_a]), PARAMS, 0.0),
            NewRequest("ab", ip.process_prompt("Compare them.", images=[img_a, img_b]), PARAMS, 0.0),
        ]
    )
    scheduler, steps, tokens, text_len = llm.engine.scheduler, [], {}, 1
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):  # what each step planned
        so = schedule(*args, **kwargs)
        steps.append([len(so.scheduled_encoder_slices.get(r, ())) for r in so.scheduled_encoder_slices])
        return so

    scheduler.schedule = recording_schedule
    per_step = []
    while loop.has_unfinished_requests():
        planned = len(steps)
        outs = {o.request_id: o for o in loop.step()}
        text = outs.get("text")
        new_text = len(text.outputs[0].token_ids) - text_len if text is not None else 0
        text_len += new_text
        per_step.append((sum(sum(s) for s in steps[planned:]), new_text))  # (under PP: the batches planned)
        tokens.update({rid: o.outputs[0].token_ids for rid, o in outs.items() if o.finished})
    llm.check_integrity()  # no KV block, encoder-cache entry, runner request or partial tower state left
    llm.shutdown()
    return per_step, tokens


def test_split_tower_equals_unsplit_and_text_decodes_every_step(deep_tower_dir):
    split_steps, split_tokens = _run(deep_tower_dir, budget=1)
    whole_steps, whole_tokens = _run(deep_tower_dir, budget=100_000)
    assert split_tokens == whole_tokens and len(split_tokens) == 3
    assert sum(n for n, _ in whole_steps) == 0  # nothing split with a big budget
    # two distinct images, DEPTH one-block slices each, one slice per step (a stage costs at least the budget)
    slice_steps = [t for n, t in split_steps if n]
    assert len(slice_steps) == 2 * DEPTH
    assert all(n == 1 for n, _ in split_steps if n)
    assert all(t == 1 for t in slice_steps)  # the text stream got a token in every slice step


def test_split_tower_under_async_scheduling_equals_unsplit(deep_tower_dir):
    """Step N + 1 (the next slice) is planned while step N runs: the runner runs the slices in order."""
    split_steps, split_tokens = _run(deep_tower_dir, budget=1, async_scheduling=True)
    _, whole_tokens = _run(deep_tower_dir, budget=100_000)
    assert split_tokens == whole_tokens and sum(n for n, _ in split_steps) == 2 * DEPTH


def test_split_tower_over_two_pipeline_stages_equals_unsplit(deep_tower_dir):
    """The first stage holds the tower and the partial states; batches in flight never hold the same request."""
    split_steps, split_tokens = _run(deep_tower_dir, budget=1, pipeline_parallel_size=2)
    _, whole_tokens = _run(deep_tower_dir, budget=100_000)
    assert split_tokens == whole_tokens and sum(n for n, _ in split_steps) == 2 * DEPTH


def test_abort_mid_encode_leaves_no_partial_state(deep_tower_dir):
    llm = LLM(deep_tower_dir, dtype="float32", num_kv_blocks=256, max_num_encoder_input_tokens=1)
    loop, ip, runner, sched = llm.engine_loop, llm.input_processor, llm.engine.runner, llm.engine.scheduler
    loop.add_requests(
        [
            NewRequest("text", ip.process_prompt("Count to ten."), TEXT_PARAMS, 0.0),
            NewRequest("a", ip.process_prompt("Describe it.", images=_images()[:1]), PARAMS, 0.0),
        ]
    )
    loop.step()
    loop.step()
    assert len(runner.encoders.partial_hashes()) == 1 and sched.encoder_cache.partial  # mid-encode
    (mm_hash,) = runner.encoders.partial_hashes()
    loop.abort("a")
    assert not sched.encoder_cache.has(mm_hash) and not sched.encoder_cache.partial
    loop.step()  # the next step tells the runner
    assert not runner.encoders.partial_hashes() and runner.encoders.lookup(mm_hash) is None
    loop.abort("text")
    llm.check_integrity()  # idle: no KV block, encoder-cache reference, runner request or partial state left
    assert not sched.encoder_cache.cached and not sched.kv.req_to_blocks and not runner.requests
