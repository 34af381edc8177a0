"""`disable_chunked_mm_input` (Gemma 3): a step never ends inside a media item's placeholder run."""

import pytest

from tests.core.test_scheduler import add, fake_run, make_sched, run_to_end
from vlserve.core.encoder_plan import _keep_items_whole
from vlserve.multimodal.inputs import MultiModalFeature


def _image(h, off, n):
    return MultiModalFeature("image", h, off, n)


@pytest.mark.parametrize(
    "start,num_new,expected",
    [
        (0, 4, 4),  # ends before the item
        (0, 6, 5),  # would end inside [5, 15): cut back to its start
        (0, 15, 15),  # ends exactly at its end
        (0, 20, 20),  # covers it whole
        (7, 5, 0),  # starts inside it (a prefix hit) and cannot reach its end: wait
        (7, 8, 8),  # starts inside it and reaches its end
        (0, 25, 22),  # the second item [22, 30) would be cut
    ],
)
def test_keep_items_whole_cuts_windows(start, num_new, expected):
    feats = [_image("a", 5, 10), _image("b", 22, 8)]
    assert _keep_items_whole(feats, start, num_new) == expected


def _chunks(**kw):
    s = make_sched(max_num_batched_tokens=8, encoder_cache_size=64, encoder_compute_budget=64, **kw)
    add(s, "a", 20, max_tokens=1, mm=[_image("i", 5, 6)])
    steps = run_to_end(s)[1]
    s.check_integrity()
    return [st["a"] for st in steps if "a" in st]


def test_default_chunking_splits_an_item():
    assert _chunks()[:2] == [8, 8]  # the first chunk ends inside positions 5..10


def test_unsplit_items_end_chunks_at_item_boundaries():
    chunks = _chunks(disable_chunked_mm_input=True)
    assert chunks[:3] == [5, 8, 7]  # text before the item; the item (6) + 2 text; the rest
    bounds = [sum(chunks[: i + 1]) for i in range(len(chunks))]
    assert not any(5 < b < 11 for b in bounds)


def test_item_longer_than_the_token_budget_is_refused():
    s = make_sched(
        max_num_batched_tokens=8, encoder_cache_size=64, encoder_compute_budget=64, disable_chunked_mm_input=True
    )
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        add(s, "a", 30, mm=[_image("big", 2, 9)])
    add(s, "b", 30, max_tokens=1, mm=[_image("fits", 2, 8)])  # exactly the budget: runs
    run_to_end(s)
    s.check_integrity()


def test_an_item_waits_for_a_budget_that_holds_it_whole():
    s = make_sched(
        max_num_batched_tokens=8, encoder_cache_size=64, encoder_compute_budget=64, disable_chunked_mm_input=True
    )
    add(s, "d", 4, max_tokens=30)
    so = s.schedule()
    s.update_from_output(so, fake_run(s, so))
    add(s, "a", 12, max_tokens=1, mm=[_image("i", 0, 8)])  # the item needs the whole budget; d decodes 1 a step
    outs, steps = run_to_end(s)
    assert "a" in outs
    assert [st["a"] for st in steps if "a" in st][0] == 8  # never 7 tokens beside d's decode
    s.check_integrity()
