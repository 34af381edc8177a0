"""The runner's per-token key limits for bidirectional image runs (vlserve.worker.bidirectional)."""

import numpy as np
import pytest
import torch

from vlserve.worker.bidirectional import step_key_limits, token_runs

IMG = 9


def test_token_runs_finds_maximal_runs():
    assert token_runs([1, IMG, IMG, 2, IMG, 3, IMG, IMG], IMG) == [(1, 2), (4, 4), (6, 7)]
    assert token_runs([1, 2, 3], IMG) == []
    assert token_runs([IMG, IMG], IMG) == [(0, 1)]


def _limits(runs_per_row, starts, q_lens):
    starts, q_lens = np.array(starts, dtype=np.int64), np.array(q_lens, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, q_lens)])  # [T], as InputBatch's
    out = step_key_limits(runs_per_row, starts, q_lens, cu, positions, torch.device("cpu"))
    return None if out is None else out.tolist()


def test_decodes_and_text_only_prefills_need_no_limits():
    assert _limits([[(0, 3)], []], [10, 0], [1, 5]) is None  # a decode past its run; a prefill without runs
    assert _limits([[(2, 4)]], [6], [3]) is None  # the run lies in the cached prefix


def test_limits_raise_tokens_of_a_run_to_its_last_position():
    # a decode (position 7) then a prefill of positions 0..7 with a run at 2..4 and a one-token run at 6
    got = _limits([[(0, 1)], [(2, 4), (6, 6)]], [7, 0], [1, 8])
    assert got == [7] + [0, 1, 4, 4, 4, 5, 6, 7]


def test_a_chunk_starting_inside_a_run_keeps_the_whole_rest():
    assert _limits([[(2, 6)]], [4], [4]) == [6, 6, 6, 7]  # positions 4..7 (a prefix hit ended at 4)


def test_a_run_cut_by_the_window_is_an_error():
    with pytest.raises(ValueError, match="cut by the step's window"):
        _limits([[(2, 6)]], [0], [5])
