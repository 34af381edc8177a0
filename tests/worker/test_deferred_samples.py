"""Deferred read-back (async scheduling): a step's sampled ids stay on the device, the next step's input ids are
filled from them there in any request order, and `output()` puts the real ids where the placeholders were."""

import numpy as np
import pytest
import torch

from vlserve.core.sched_output import ModelRunnerOutput
from vlserve.sampling_params import SamplingParams
from vlserve.worker.deferred_samples import PENDING_TOKEN, DeviceTokenFeed, StepHandle
from vlserve.worker.request_state import CachedRequestState

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _state(rid: str, tokens: list[int]) -> CachedRequestState:
    return CachedRequestState(
        req_id=rid,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        sampling_params=SamplingParams(),
        generator=None,
        block_ids=[0],
        num_computed_tokens=0,
    )


def _launch(feed, states, sampled):
    """A step that sampled `sampled[i]` for states[i], left on the feed's device."""
    handle = StepHandle(ModelRunnerOutput(req_ids=[s.req_id for s in states], sampled_token_ids=[[] for _ in states]))
    feed.defer(handle, states, list(range(len(states))), torch.tensor(sampled, dtype=torch.long, device=feed.device))
    return handle


def _step_ids(windows, starts):
    """Host ids [T], positions [T] and cu [B + 1] of a step whose request i reads windows[i] from starts[i]."""
    ids = np.array([t for w in windows for t in w], dtype=np.int64)
    pos = np.array([s + j for w, s in zip(windows, starts) for j in range(len(w))], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum([len(w) for w in windows])])
    return ids, pos, cu


@pytest.mark.parametrize("device", DEVICES)
def test_fill_takes_each_placeholder_from_its_request_sample_in_any_order(device):
    feed = DeviceTokenFeed(torch.device(device))
    a, b, c = _state("a", [5, 6]), _state("b", [7]), _state("c", [8, 9, 10])
    h = _launch(feed, [a, b, c], [11, 12, 13])
    assert a.token_ids == [5, 6, PENDING_TOKEN] and c.token_ids[-1] == PENDING_TOKEN
    # next step: c and a decode (reversed order), a new request d prefills 3 known tokens
    d = _state("d", [1, 2, 3])
    batch = [c, a, d]
    windows = [c.token_ids[-1:], a.token_ids[-1:], d.token_ids[:3]]
    ids, pos, cu = _step_ids(windows, [3, 2, 0])
    dev = torch.from_numpy(ids.copy()).to(device)
    feed.fill(dev, ids, pos, cu, batch)
    assert dev.tolist() == [13, 11, 1, 2, 3]
    assert feed.num_fed_tokens == 2
    out = h.output()
    assert out.sampled_token_ids == [[11], [12], [13]]
    assert a.token_ids == [5, 6, 11] and b.token_ids == [7, 12] and c.token_ids == [8, 9, 10, 13]
    assert h.output() is out  # read back once


@pytest.mark.parametrize("device", DEVICES)
def test_fill_in_order_copies_the_prefix_and_a_read_back_placeholder_needs_nothing(device):
    feed = DeviceTokenFeed(torch.device(device))
    states = [_state(str(i), [i]) for i in range(4)]
    h = _launch(feed, states, [20, 21, 22, 23])
    ids, pos, cu = _step_ids([s.token_ids[-1:] for s in states], [1] * 4)
    dev = torch.zeros(6, dtype=torch.long, device=device)  # the persistent buffer is longer than the step
    feed.fill(dev, ids, pos, cu, states)
    assert dev[:4].tolist() == [20, 21, 22, 23]
    h.output()
    ids, pos, cu = _step_ids([s.token_ids[-1:] for s in states], [1] * 4)
    assert (ids >= 0).all()  # read back: the host knows the ids, nothing is filled
    feed.fill(torch.zeros(4, dtype=torch.long, device=device), ids, pos, cu, states)
    assert feed.num_fed_tokens == 4


def test_fill_refuses_a_placeholder_that_is_not_the_latest_sample():
    feed = DeviceTokenFeed(torch.device("cpu"))
    s = _state("a", [1])
    _launch(feed, [s], [2])
    _launch(feed, [s], [3])  # a second sample before the first was read back
    ids, pos, cu = _step_ids([s.token_ids[1:2]], [1])  # the older placeholder
    with pytest.raises(RuntimeError, match="latest sample"):
        feed.fill(torch.from_numpy(ids.copy()), ids, pos, cu, [s])


@pytest.mark.parametrize("device", DEVICES)
def test_read_back_pending_makes_penalty_history_real(device):
    feed = DeviceTokenFeed(torch.device(device))
    s = _state("a", [1, 2])
    h = _launch(feed, [s], [9])
    assert s.output_token_ids == [PENDING_TOKEN]
    feed.read_back_pending([s])
    assert s.output_token_ids == [9] and h.output().sampled_token_ids == [[9]]


def test_step_seconds_count_the_launch_and_the_read_back_not_the_time_between():
    """The engine sizes the per-step encoder budget from step_seconds: the steps run between a launch and its
    read-back (the next step's launch, under async scheduling) must not count in it."""
    import time

    feed = DeviceTokenFeed(torch.device("cpu"))
    s = _state("a", [1])
    h = _launch(feed, [s], [4])
    h._out.step_seconds = 0.5  # as the runner sets it when the launch ends
    time.sleep(0.2)
    assert 0.5 <= h.output().step_seconds < 0.6
