"""Gemma 3 VLM through the engine's scheduling limits (the model, prompt ids and plain parity are in
test_gemma3_vlm.py): forced preemption with a small KV pool and steps barely above an image item, a step budget that
would cut a run of soft tokens without the keep-whole rule (no step ends inside one; HF's tokens), an item longer
than max_num_batched_tokens refused with a clear ValueError while the engine keeps serving, and the OpenAI server
with an image_url against HF's decoded greedy text."""

from __future__ import annotations

import pytest

from tests.multimodal.mm_server import assert_server_image_parity
from tests.multimodal.test_gemma3_vlm import MAX_NEW, Gemma3Oracle, _cases, _img, _run
from vlserve import LLM

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

ITEM = 16  # soft tokens per image / crop (mm_tokens_per_image of the test checkpoint)


@pytest.fixture(scope="module")
def g3_dir(tmp_path_factory):
    from tests.support.gemma3_checkpoints import build_gemma3_vlm_checkpoint

    return build_gemma3_vlm_checkpoint(str(tmp_path_factory.mktemp("gemma3_vlm_engine")))


@pytest.fixture(scope="module")
def oracle(g3_dir):
    return Gemma3Oracle(g3_dir, MAX_NEW)


@pytest.fixture(scope="module")
def expected(oracle):
    return [oracle.run(text, imgs, **(kw or {})) for _, text, imgs, kw in _cases(oracle)]


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _record_steps(llm) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Wrap the scheduler: per planned step and request, (first position, end, the request's item runs)."""
    sched = llm.engine.scheduler
    plan, steps = sched.schedule, []

    def schedule(*args, **kwargs):  # the engine may pass the batch queue's max_num_reqs
        out = plan(*args, **kwargs)
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            end = req.num_computed_tokens  # schedule() has already advanced it over this step
            steps.append((end - n, end, [(f.offset, f.offset + f.length) for f in req.mm_features]))
        return out

    sched.schedule = schedule
    return steps


def test_chunked_prefill_with_forced_preemption(g3_dir, oracle, expected):
    """18-token steps (one 16-token item fits, with 2 tokens to spare) and 26 blocks x 16 slots shared by the full
    and the two sliding-window groups: the batch (the 234-token pan-and-scan prompt included) cannot fit at once,
    requests are preempted and recomputed, outputs stay HF's."""
    llm = LLM(
        g3_dir,
        dtype="float32",
        num_kv_blocks=26,
        block_size=16,
        max_num_batched_tokens=ITEM + 2,
        enable_prefix_caching=False,
    )
    assert _tokens(_run(llm, _cases(oracle))) == [e[1] for e in expected]
    assert llm.get_metrics()["vlserve:num_preemptions_total"] > 0
    llm.check_integrity()


def test_step_budget_never_cuts_an_image_run(g3_dir, oracle):
    """Steps of ITEM + 1 tokens with text before each image: cutting every prompt at multiples of the budget would
    end steps inside the runs; the scheduler ends them at the run's edges instead (recorded per step) and the tokens
    are HF's (a run cut in two would lose its bidirectional keys)."""
    proc = oracle.processor
    long_first = proc.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Please look carefully at the following picture before you answer"},
                    {"type": "image"},
                    {"type": "text", "text": "and this one as well"},
                    {"type": "image"},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    cases = [("text first", long_first, [_img((40, 90), seed=5), _img((100, 30), seed=6)], None)] + _cases(oracle)[1:4]
    want = [oracle.run(text, imgs)[1] for _, text, imgs, _ in cases]
    budget = ITEM + 1
    llm = LLM(g3_dir, dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=budget)
    steps = _record_steps(llm)
    outs = _run(llm, cases)
    assert _tokens(outs) == want
    ids, soft = outs[0].prompt_token_ids, oracle.model.config.image_token_index
    first_runs = [(i, i + ITEM) for i, t in enumerate(ids) if t == soft and ids[i - 1] != soft]
    assert len(first_runs) == 2 and ids[first_runs[0][0] : first_runs[0][1]] == [soft] * ITEM
    naive_ends = range(budget, len(ids), budget)  # the prompt alone cut every `budget` tokens: inside both runs
    assert all(any(a < e < b for e in naive_ends) for a, b in first_runs), first_runs
    assert sum(bool(runs) for *_, runs in steps) > 2 * len(cases)  # every image prompt spanned several steps
    for start, end, runs in steps:
        assert not any(a < start < b or a < end < b for a, b in runs), (start, end, runs)
    llm.check_integrity()


def test_item_longer_than_step_budget_is_refused(g3_dir, oracle, expected):
    """max_num_batched_tokens below an image's 16 soft tokens: LLM.generate raises a ValueError naming the limit
    (alone or next to a text prompt), nothing is left queued, and text prompts are still served (HF's tokens)."""
    llm = LLM(g3_dir, dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=ITEM - 4)
    text_only, one_image = _cases(oracle)[:2]
    for batch in ([one_image], [text_only, one_image]):
        with pytest.raises(
            ValueError,
            match=r"image item 0 has 16 placeholder tokens, more than "
            r"max_num_batched_tokens=12",
        ):
            _run(llm, batch)
        assert not llm.engine.scheduler.requests and not llm.engine.scheduler.waiting
    assert _tokens(_run(llm, [text_only, text_only])) == [expected[0][1]] * 2
    llm.check_integrity()


def test_server_image_url_parity_with_hf(g3_dir, oracle, expected):
    _, text, imgs, _ = _cases(oracle)[1]
    assert len(expected[1][0]) == oracle.inputs(text, imgs)["input_ids"].shape[1]
    assert_server_image_parity(
        g3_dir,
        imgs[0],
        expected[1][1],
        oracle.processor.tokenizer,
        len(expected[1][0]),
        MAX_NEW,
        "tiny-gemma3",
        max_num_batched_tokens=ITEM + 4,
    )
