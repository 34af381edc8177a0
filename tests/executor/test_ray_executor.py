"""The Ray executor backend: tensor-parallel ranks and pipeline stages as Ray actors on a local cluster, against one
rank in process.

One module-scoped local Ray cluster (4 CPUs, no dashboard) serves every test and is shut down at the end. Until the
model layers are sharded, each rank holds the whole model; the outputs must match token for token either way.
"""

from __future__ import annotations

import logging
import sys
import time

import pytest

from vlserve import LLM, SamplingParams
from vlserve.config import EngineArgs
from vlserve.executor import WorkerDied, build_executor
from vlserve.executor.worker import WorkerSettings

# Few KV blocks (preemption), a small token budget (chunked prefill); block_size 16.
ENGINE_KW = dict(dtype="float32", num_kv_blocks=7, max_model_len=128, max_num_batched_tokens=24, max_num_seqs=4, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SHARED = "The quick brown fox jumps over the lazy dog while the cat watches from the tall old fence"
PROMPTS = [
    SHARED + " and then",
    "Hello world, this is a longer prompt about colours and shapes",
    "What color is the circle?",
    SHARED + " but later",
]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("qwen2-ray")), arch="qwen2", num_layers=2)


@pytest.fixture(scope="module")
def one_rank_tokens(model_dir) -> list[list[int]]:
    """What one process makes of PROMPTS: the tokens every Ray engine here must equal."""
    reference = LLM(model=model_dir, tensor_parallel_size=1, **ENGINE_KW)
    try:
        return _run(reference)
    finally:
        reference.shutdown()


def _run(llm: LLM) -> list[list[int]]:
    first = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    again = llm.generate(PROMPTS[3:], GREEDY, use_tqdm=False)  # shares SHARED's cached blocks
    return [o.outputs[0].token_ids for o in first + again]


def _live_placement_groups(ray) -> list:
    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


@pytest.mark.slow
def test_ray_tp2_matches_one_rank(ray_cluster, model_dir, one_rank_tokens):
    llm = LLM(model=model_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KW)
    try:
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        got = _run(llm)
        metrics = llm.get_metrics()
        shards = llm.engine.executor.collective_rpc("shard_info")
        llm.check_integrity()
    finally:
        llm.shutdown()
    assert got == one_rank_tokens
    assert metrics["vlserve:num_preemptions_total"] > 0
    assert metrics["vlserve:prefix_cache_hits_total"] > 0
    assert [s["rank"] for s in shards] == [0, 1] and {s["world_size"] for s in shards} == {2}
    assert _live_placement_groups(ray_cluster) == []


@pytest.mark.slow
def test_killed_rank_raises_worker_died_and_shutdown_works(ray_cluster, model_dir):
    llm = LLM(model=model_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KW)
    try:
        executor = llm.engine.executor
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        ray_cluster.kill(executor.actors[1], no_restart=True)
        start = time.monotonic()
        with pytest.raises(WorkerDied, match=r"tensor-parallel rank 1 \(Ray actor \w+\) died"):
            llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
        assert executor.actors == []  # the surviving rank was killed too
        with pytest.raises(WorkerDied):  # and the executor stays dead
            executor.collective_rpc("shard_info")
    finally:
        llm.shutdown()
    assert _live_placement_groups(ray_cluster) == []
    assert ray_cluster.is_initialized()  # not ours to shut down


@pytest.mark.slow
def test_missing_resources_named_after_timeout(ray_cluster, model_dir, monkeypatch):
    from vlserve.executor import ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(RuntimeError, match=r"could not place 8 ranks \(8 TP x 1 PP, \{'CPU': 1\} each\)"):
        LLM(model=model_dir, tensor_parallel_size=8, distributed_executor_backend="ray", **ENGINE_KW)
    assert _live_placement_groups(ray_cluster) == []


def test_factory_without_ray_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    args = EngineArgs(model="unused", tensor_parallel_size=2, distributed_executor_backend="ray")
    settings = WorkerSettings(args, "unused", max_model_len=64, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=r"install vlserve\[ray\]"):
        build_executor(settings)


@pytest.mark.slow
def test_ray_pp2_matches_one_rank(ray_cluster, model_dir, one_rank_tokens):
    # two stage actors (one layer each) in one placement group; the last stage's output is the step's
    llm = LLM(model=model_dir, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KW)
    try:
        executor = llm.engine.executor
        assert type(executor).__name__ == "RayExecutor" and executor.output_rank == 1
        got = _run(llm)
        metrics = llm.get_metrics()
        shards = executor.collective_rpc("shard_info")
        llm.check_integrity()
        ray_cluster.kill(executor.actors[0], no_restart=True)  # the first stage: the last one waits on its hand-over
        start = time.monotonic()
        with pytest.raises(WorkerDied, match=r"rank 0 \(pipeline stage 0\) \(Ray actor \w+\) died"):
            llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()
    assert got == one_rank_tokens
    assert metrics["vlserve:num_preemptions_total"] > 0
    assert metrics["vlserve:prefix_cache_hits_total"] > 0
    assert metrics["vlserve:max_batches_in_flight"] == 2  # the actors queue steps: two batches at once
    assert [(s["pp_rank"], s["pp_size"], s["layers"]) for s in shards] == [(0, 2, (0, 1)), (1, 2, (1, 2))]
    assert _live_placement_groups(ray_cluster) == []
