"""LoRAModelManager: device slots (LRU eviction, max_loras per step), the host LRU (max_cpu_loras), adding and
removing adapters, a reused slot holding no stale weights, unwrapping."""

from __future__ import annotations

import pytest
import torch

from tests.lora.lora_helpers import ALL, make_adapter, our_model
from tests.support.paged_runner import PagedRunner
from vlserve.lora import LoRAModelManager, LoRARequest
from vlserve.lora.layers import LoRALayerMixin

PROMPT = [5, 17, 42, 7, 99, 3]


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    """(model_dir, cfg, {id: LoRARequest}) with four adapters: 1 all projections, 2 q/v, 3 MLP, 4 o_proj."""
    model_dir, cfg = checkpoint("qwen2")
    d = tmp_path_factory.mktemp("mgr")
    targets = {1: ALL, 2: ["q_proj", "v_proj"], 3: ["gate_proj", "up_proj", "down_proj"], 4: ["o_proj"]}
    reqs = {
        i: LoRARequest(f"a{i}", i, make_adapter(model_dir, d / f"a{i}", t, r=2 * i, alpha=8, seed=i)[0])
        for i, t in targets.items()
    }
    return model_dir, cfg, reqs


def _logits(model, cfg, manager, ref):
    return PagedRunner(model, cfg, lora_manager=manager).step([("x", PROMPT)], adapters={"x": ref})["x"]


def test_slots_lru_and_max_loras(setup):
    model_dir, cfg, reqs = setup
    manager = LoRAModelManager(our_model(model_dir, cfg), max_loras=2, max_lora_rank=8, max_cpu_loras=4)
    slots = manager.prepare_step([reqs[1], None, reqs[2]], [2, 1, 3])
    assert slots.tolist() == [0, 0, -1, 1, 1, 1]
    manager.prepare_step([1])  # 1 used last: 2 is the least recently used slot
    manager.prepare_step([reqs[3]])
    assert (manager.slot_of(1), manager.slot_of(2), manager.slot_of(3)) == (0, None, 1)
    manager.prepare_step([3, 3])
    manager.prepare_step([2, 3])  # 1 is evicted, not 3 (used by this step)
    assert (manager.slot_of(1), manager.slot_of(2), manager.slot_of(3)) == (None, 0, 1)
    with pytest.raises(ValueError, match=r"3 distinct LoRA adapters, more than max_loras \(2\)"):
        manager.prepare_step([1, 2, 3])
    with pytest.raises(ValueError, match="LoRA adapter id 9 is not loaded"):
        manager.prepare_step([9])
    with pytest.raises(ValueError, match="3 adapters for 2 requests"):
        manager.prepare_step([1, 2, 0], [1, 1])


def test_host_lru_add_remove_list(setup):
    model_dir, cfg, reqs = setup
    manager = LoRAModelManager(our_model(model_dir, cfg), max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    assert manager.add_adapter(reqs[1]) and manager.add_adapter(reqs[2])
    manager.prepare_step([2])
    assert manager.slot_of(2) == 0
    assert not manager.add_adapter(reqs[1])  # held already: only marked the most recently used
    assert manager.add_adapter(reqs[3])  # evicts 2, the least recently used, and frees its slot
    assert list(manager.list_adapters()) == [1, 3] and manager.slot_of(2) is None
    assert manager.list_adapters()[3] == reqs[3]
    assert manager.remove_adapter(1) and not manager.remove_adapter(1)
    assert list(manager.list_adapters()) == [3]


def test_reused_slot_has_no_stale_weights(setup):
    """Adapter 4 (o_proj only) in the slot adapter 1 (every projection) held equals adapter 4 in a fresh slot."""
    model_dir, cfg, reqs = setup
    model = our_model(model_dir, cfg)
    manager = LoRAModelManager(model, max_loras=1, max_lora_rank=8)
    fresh = _logits(model, cfg, manager, reqs[4])
    _logits(model, cfg, manager, reqs[1])
    assert manager.slot_of(1) == 0 and manager.slot_of(4) is None
    assert torch.equal(_logits(model, cfg, manager, reqs[4]), fresh)
    manager.remove_adapter(4)
    assert all(not any(layer.lora_ranks[0]) for layer in manager.targets.values())


def test_construction_errors_and_unwrap(setup):
    model_dir, cfg, reqs = setup
    model = our_model(model_dir, cfg)
    base = _logits(model, cfg, None, None)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LoRAModelManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=1)
    manager = LoRAModelManager(model, max_loras=1, max_lora_rank=8)
    assert len(manager.targets) == 4 * cfg.num_hidden_layers
    with pytest.raises(ValueError, match="already belong to a LoRAModelManager"):
        LoRAModelManager(model, max_loras=1, max_lora_rank=8)
    assert torch.equal(_logits(model, cfg, manager, None), base)  # no adapter in the step: the base model
    _logits(model, cfg, manager, reqs[1])
    manager.unwrap_model()
    assert not any(isinstance(m, LoRALayerMixin) for m in model.modules())
    assert torch.equal(_logits(model, cfg, None, None), base)


def test_loading_off_the_step_loop(setup, tmp_path):
    """start_loading reads the files on a background thread; finished_loads holds the adapter (the same logits as
    a synchronous add) or reports its error; a step needing an adapter still being read waits for that read."""
    import time

    model_dir, cfg, reqs = setup
    manager = LoRAModelManager(our_model(model_dir, cfg), max_loras=2, max_lora_rank=8, max_cpu_loras=4)
    sync = LoRAModelManager(our_model(model_dir, cfg), max_loras=2, max_lora_rank=8, max_cpu_loras=4)
    bad = LoRARequest("bad", 7, str(tmp_path / "nowhere"))
    assert manager.start_loading(reqs[1]) and manager.start_loading(bad)
    assert not manager.start_loading(reqs[1])  # being read already
    done: dict = {}
    deadline = time.monotonic() + 30
    while len(done) < 2 and time.monotonic() < deadline:
        done.update(manager.finished_loads())
        time.sleep(0.01)
    assert done[1] is None and "missing adapter_config.json" in done[7]
    assert set(manager.list_adapters()) == {1}
    torch.testing.assert_close(_logits(manager.model, cfg, manager, 1), _logits(sync.model, cfg, sync, reqs[1]))
    assert manager.start_loading(reqs[2])
    _logits(manager.model, cfg, manager, reqs[2])  # the step waits for the read under way, then holds it
    assert set(manager.list_adapters()) == {1, 2} and manager.finished_loads() == {}
    assert manager.start_loading(reqs[3]) and manager.remove_adapter(3)  # a load under way can be dropped
    assert manager.finished_loads() == {} and 3 not in manager.list_adapters()
