"""EngineLoop: the one add / fan-out / rollback / abort / step path that LLM and AsyncLLM share; LoadedModel setup."""

import ast
import dataclasses
import inspect
import time

import pytest

from vlserve import SamplingParams
from vlserve.config import EngineArgs
from vlserve.engine import mm_setup
from vlserve.engine.engine_loop import EngineLoop, NewRequest


@pytest.fixture(scope="module")
def loop(qwen2_dir):
    return EngineLoop(EngineArgs(model=qwen2_dir, dtype="float32", num_kv_blocks=64, max_model_len=128, seed=0))


def _req(loop, rid, prompt, n=1, max_tokens=4):
    params = SamplingParams(temperature=0.0 if n == 1 else 1.0, seed=1, n=n, max_tokens=max_tokens, ignore_eos=True)
    return NewRequest(rid, loop.input_processor.process_prompt(prompt), params, time.time())


def _assert_idle(loop):
    assert not loop.has_unfinished_requests() and not loop.output_processor.parents
    assert not loop.output_processor.open_seqs
    loop.core.check_integrity()


def _run_to_end(loop):
    finished = {}
    while loop.has_unfinished_requests():
        finished.update({o.request_id: o for o in loop.step() if o.finished})
    return finished


def test_fan_out_and_step_to_completion(loop):
    loop.add_requests([_req(loop, "fan", "hello there", n=3), _req(loop, "one", "good morning")])
    assert sorted(loop.core.scheduler.requests) == ["0_fan", "1_fan", "2_fan", "one"]
    finished = _run_to_end(loop)
    assert sorted(finished) == ["fan", "one"]
    assert [c.index for c in finished["fan"].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 4 for o in finished.values() for c in o.outputs)
    _assert_idle(loop)


def test_failed_batch_leaves_nothing_queued(loop):
    too_long = NewRequest(
        "bad", loop.input_processor.process_prompt([5] * 200), SamplingParams(max_tokens=2), time.time()
    )
    with pytest.raises(ValueError, match="max_model_len"):
        loop.add_requests([_req(loop, "good", "a fine prompt", n=2), too_long])
    _assert_idle(loop)
    loop.add_requests([_req(loop, "good", "a fine prompt", n=2)])  # the id was not left behind
    assert sorted(_run_to_end(loop)) == ["good"]
    _assert_idle(loop)


def test_duplicate_ids_are_refused(loop):
    with pytest.raises(ValueError, match="'twin' is already in use"):
        loop.add_requests([_req(loop, "twin", "x y"), _req(loop, "twin", "x y z")])
    _assert_idle(loop)
    loop.add_requests([_req(loop, "open", "some words", max_tokens=50)])
    with pytest.raises(ValueError, match="already in use"):
        loop.add_requests([_req(loop, "open", "other words")])
    assert list(loop.output_processor.parents) == ["open"]
    loop.abort_all()
    _assert_idle(loop)


def test_abort_returns_final_output_and_frees_everything(loop):
    loop.add_requests([_req(loop, "cut", "count with me", n=2, max_tokens=50)])
    loop.step()
    final = loop.abort("cut")
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort", "abort"]
    assert loop.abort("cut") is None and loop.abort("never-added") is None
    _run_to_end(loop)
    _assert_idle(loop)


def test_abort_all_clears_core_and_outputs(loop):
    loop.add_requests([_req(loop, "p", "first one", max_tokens=50), _req(loop, "q", "second", n=2, max_tokens=50)])
    loop.step()
    assert sorted(loop.abort_all()) == ["p", "q"]
    _run_to_end(loop)
    _assert_idle(loop)


def test_loaded_model_is_built_whole(loop):
    loaded = loop.core.loaded
    assert loaded.modalities == () and loaded.mm_processor is None and loaded.mrope_positions_fn is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.mm_processor = object()


def test_mm_setup_does_not_import_model_setup():
    tree = ast.parse(inspect.getsource(mm_setup))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "vlserve.engine.model_setup" not in imported


def test_step_final_only_returns_just_the_finished_outputs(loop):
    """LLM's path: final_only skips the per-step output of open requests; the final outputs are the full ones."""
    loop.add_requests(
        [_req(loop, "fo-short", "hello there", max_tokens=2), _req(loop, "fo-long", "hello there", max_tokens=5)]
    )
    every_step, final = [], {}
    while loop.has_unfinished_requests():
        outs = loop.step(final_only=True)
        every_step.append(sorted((o.request_id, o.finished) for o in outs))
        final.update({o.request_id: o for o in outs})
    assert all(done for step in every_step for _, done in step)
    assert [rid for step in every_step for rid, _ in step] == ["fo-short", "fo-long"]
    assert len(final["fo-short"].outputs[0].token_ids) == 2 and len(final["fo-long"].outputs[0].token_ids) == 5
    loop.add_requests([_req(loop, "fo-again", "hello there", max_tokens=5)])
    open_outputs = 0
    while loop.has_unfinished_requests():
        for o in loop.step():  # the default still returns every touched request, finished or not
            final[o.request_id] = o
            open_outputs += not o.finished
    assert open_outputs == 4
    assert final["fo-again"].outputs[0].token_ids == final["fo-long"].outputs[0].token_ids
    _assert_idle(loop)
