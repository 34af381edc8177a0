"""The engine's side of reasoning, pure Python: the tracker's states over kept tokens, its budget, the drafts it
lets through, the scheduler feeding a grammar only the tokens after the reasoning, and the bitmask rows that
force the end token or let the start token in."""

from __future__ import annotations

import numpy as np
import pytest

from tests.core.test_grammar_sync import FakeMatcher, _run
from tests.core.test_scheduler import make_sched
from vlserve.core.grammar_sync import apply_reasoning_rows, bitmask_rows
from vlserve.core.request import EngineCoreRequest
from vlserve.reasoning import ReasoningState, ReasoningTokens, ReasoningTracker
from vlserve.sampling_params import SamplingParams

START, END = 90, 91
QWEN3 = ReasoningTokens(START, END, reasoning_by_default=False)
OPEN, CLOSED, PLAIN = [1, 2, START, 3], [1, START, END, 3], [1, 2, 3]


def test_states_follow_the_prompt_and_the_tokens():
    assert ReasoningTracker(QWEN3, OPEN).state is ReasoningState.REASONING
    assert ReasoningTracker(QWEN3, CLOSED).state is ReasoningState.ENDED
    pending = ReasoningTracker(QWEN3, PLAIN)
    assert pending.state is ReasoningState.PENDING
    assert pending.advance([START, 5, 6]) == [] and pending.num_reasoning_tokens == 2
    assert pending.advance([7, END, 8, 9]) == [8, 9] and pending.ended and pending.num_reasoning_tokens == 3
    no_think = ReasoningTracker(QWEN3, PLAIN)
    assert no_think.advance([5, 6]) == [5, 6] and no_think.ended and no_think.num_reasoning_tokens == 0
    r1 = ReasoningTracker(ReasoningTokens(START, END, reasoning_by_default=True), PLAIN)
    assert r1.state is ReasoningState.REASONING


def test_budget_forces_the_end_token_where_it_is_spent():
    t = ReasoningTracker(QWEN3, OPEN, budget=3)
    assert t.forced_token(0) is None and t.forced_token(2) is None and t.forced_token(3) == END
    t.advance([5, 6])
    assert t.forced_token(0) is None and t.forced_token(1) == END
    assert t.allowed_drafts([7, 8, 9]) == [7]  # the forced end comes as the bonus token
    t.advance([7])
    assert t.forced_token(0) == END
    t.advance([END])
    assert t.forced_token(0) is None and t.ended
    assert ReasoningTracker(QWEN3, OPEN, budget=0).forced_token(0) == END
    assert ReasoningTracker(QWEN3, PLAIN, budget=0).forced_token(0) is None  # pending: nothing to end yet
    with pytest.raises(ValueError, match="thinking_token_budget"):
        ReasoningTracker(QWEN3, OPEN, budget=-1)


def test_drafts_stop_before_a_tag_and_none_while_pending():
    assert ReasoningTracker(QWEN3, OPEN).allowed_drafts([5, 6, END, 7]) == [5, 6]
    assert ReasoningTracker(QWEN3, PLAIN).allowed_drafts([START, 5]) == []
    assert ReasoningTracker(QWEN3, CLOSED).allowed_drafts([5, START]) == [5, START]


def _add(s, rid, prompt, matcher=None, tracker=None, max_tokens=10):
    s.add_request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), 0.0, []), matcher, tracker)


def _step(s, tokens: dict[str, int]):
    so = s.schedule()
    out = _run(s, so)
    out.sampled_token_ids = [[tokens[rid]] if t else [] for rid, t in zip(out.req_ids, out.sampled_token_ids)]
    s.update_from_output(so, out)
    return so


def test_the_grammar_sees_only_the_tokens_after_the_reasoning():
    s = make_sched()
    matcher = FakeMatcher(allowed=range(10), length=2)  # refuses the tags and reasoning tokens >= 10
    _add(s, "a", OPEN, matcher, ReasoningTracker(QWEN3, OPEN))
    for token in (50, 60, END, 4, 5):
        _step(s, {"a": token})
    req = s.requests.get("a")
    assert matcher.accepted == [4, 5]
    assert req is None or req.is_finished()  # the grammar ended, so did the request
    s.check_integrity()


def test_bitmask_rows_force_the_end_and_allow_the_start():
    s = make_sched()
    forced = ReasoningTracker(QWEN3, OPEN, budget=1)
    forced.advance([50])
    _add(s, "forced", OPEN, FakeMatcher(), forced)
    _add(s, "pending", PLAIN, FakeMatcher(), ReasoningTracker(QWEN3, PLAIN))
    _add(s, "free", OPEN, FakeMatcher(), ReasoningTracker(QWEN3, OPEN))  # reasoning, budget left: no row
    _add(s, "plain", PLAIN, FakeMatcher())  # a grammar and no tracker: its grammar row
    so = s.schedule()
    rows = bitmask_rows(s.requests, so.num_scheduled_tokens, so.scheduled_spec_decode_tokens)
    assert set(rows.first_row) == {"forced", "pending", "plain"}
    assert rows.force_only == {rows.first_row["forced"]: END}
    assert rows.also_allow == {rows.first_row["pending"]: START}
    assert rows.matchers[list(rows.first_row).index("forced")] is None

    bitmask = np.zeros((rows.num_rows, 4), dtype=np.int32)  # a grammar that allows nothing, 128 tokens
    apply_reasoning_rows(bitmask, rows.force_only, rows.also_allow)
    allowed = [np.flatnonzero(np.unpackbits(r.view(np.uint8), bitorder="little")).tolist() for r in bitmask]
    assert allowed[rows.first_row["forced"]] == [END]
    assert allowed[rows.first_row["pending"]] == [START]
    assert allowed[rows.first_row["plain"]] == []
    full = np.full((1, 2), -1, dtype=np.int32)
    apply_reasoning_rows(full, {0: 31}, {})  # bit 31 is the sign bit of an int32 word
    assert np.unpackbits(full[0].view(np.uint8), bitorder="little").nonzero()[0].tolist() == [31]
