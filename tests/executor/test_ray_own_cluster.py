"""With no Ray cluster initialised, the Ray executor starts a local one and shuts it down again on shutdown.

Kept apart from test_ray_executor.py, whose module-scoped cluster must not be running while this test runs.
"""

from __future__ import annotations

import pytest

from vlserve import LLM, SamplingParams


@pytest.mark.slow
def test_executor_starts_and_stops_its_own_local_cluster(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    from vlserve.demo.checkpoints import build_text_checkpoint

    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model_dir = build_text_checkpoint(str(tmp_path / "qwen2"), arch="qwen2", num_layers=1)
    llm = LLM(
        model=model_dir, dtype="float32", num_kv_blocks=16, tensor_parallel_size=2, distributed_executor_backend="ray"
    )
    try:
        assert ray.is_initialized() and llm.engine.executor.started_ray
        resources = ray.cluster_resources()
        out = llm.generate(
            "Hello world", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
        )
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
    assert resources.get("CPU", 0) >= 2  # room for both ranks, whatever the machine's core count
    assert not ray.is_initialized()  # the cluster it started is gone with it
