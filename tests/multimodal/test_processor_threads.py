"""MultiModalProcessor from several threads (the server's preprocessing pool): distinct images are processed at the
same time, one image asked for by many threads at once runs the HF processor once (one miss, the rest hits), and
results equal the one-thread ones."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from mm_media import rand_image

from vlserve.multimodal.processor import MultiModalProcessor


class _Recording:
    """Stands in for the HF image processor: records the threads inside `__call__` and can hold them there."""

    def __init__(self, inner, barrier: threading.Barrier | None = None, fail: bool = False):
        self.inner = inner
        self.barrier = barrier
        self.fail = fail
        self.calls: list[str] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.hold = False

    def __call__(self, *args, **kwargs):
        self.calls.append(threading.current_thread().name)
        self.entered.set()
        if self.barrier is not None:
            self.barrier.wait()  # BrokenBarrierError if the calls never overlap
        if self.hold:
            assert self.release.wait(30)
        if self.fail:
            raise RuntimeError("boom")
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def proc():
    from vlserve.demo import default_model_path

    return MultiModalProcessor.from_pretrained(default_model_path())


def test_distinct_images_are_processed_concurrently_and_equal_sequential(proc):
    images = [rand_image(40 + 10 * i, 90 - 10 * i, seed=i) for i in range(4)]
    expected = [proc.process_image(img)[1] for img in images]
    proc.clear_cache()
    proc.image_processor = _Recording(proc.image_processor, barrier=threading.Barrier(4, timeout=20))
    with ThreadPoolExecutor(4, thread_name_prefix="pool") as pool:
        got = list(pool.map(lambda img: proc.process_image(img)[1], images))
    assert len(set(proc.image_processor.calls)) == 4  # four threads were inside the HF call together
    for a, b in zip(got, expected):
        assert torch.equal(a["pixel_values"], b["pixel_values"])
        assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    assert (proc.cache_misses, proc.cache_hits) == (8, 0)


def test_one_image_from_many_threads_runs_once(proc):
    img = rand_image(64, 48, seed=7)
    rec = proc.image_processor = _Recording(proc.image_processor)
    rec.hold = True
    with ThreadPoolExecutor(6) as pool:
        first = pool.submit(proc.process_image, img)
        assert rec.entered.wait(20)
        rest = [pool.submit(proc.process_image, img) for _ in range(5)]
        rec.release.set()
        results = [first.result(30)] + [f.result(30) for f in rest]
    assert len(rec.calls) == 1
    assert len({h for h, _ in results}) == 1 and all(d is results[0][1] for _, d in results)
    assert (proc.cache_misses, proc.cache_hits) == (1, 5)
    proc.process_image(img)  # from the cache now
    assert (proc.cache_misses, proc.cache_hits, len(rec.calls)) == (1, 6, 1)


def test_a_failure_reaches_the_waiters_and_is_not_cached(proc):
    img = rand_image(30, 30, seed=8)
    rec = proc.image_processor = _Recording(proc.image_processor, fail=True)
    rec.hold = True
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(proc.process_image, img)
        assert rec.entered.wait(20)
        second = pool.submit(proc.process_image, img)
        time.sleep(1.0)  # let it reach the wait on the first one's result
        rec.release.set()
        for fut in (first, second):
            with pytest.raises(ValueError, match="image processing failed"):
                fut.result(30)
    rec.fail, rec.hold = False, False
    assert proc.process_image(img)[1]["pixel_values"].numel() > 0  # computed again, not a stuck entry
    assert len(rec.calls) == 2
