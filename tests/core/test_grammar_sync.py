"""The scheduler with constrained requests (a fake matcher, no grammar engine, no torch): a request waits while its
grammar compiles and others go ahead, kept tokens advance the matcher, a finished grammar stops the request, drafts
are cut to what the grammar allows, a failed compile ends the request "abort" without leaking, and the bitmask
rows cover exactly the constrained requests that sample."""

from tests.core.test_scheduler import make_sched
from vlserve.core.grammar_sync import bitmask_rows
from vlserve.core.request import EngineCoreRequest
from vlserve.core.sched_output import ModelRunnerOutput
from vlserve.sampling_params import SamplingParams


class FakeMatcher:
    """Accepts tokens from `allowed`; terminates after `length` tokens; ready once `ready` is set."""

    def __init__(self, allowed=range(100), length=3, ready=True, error=None):
        self.allowed, self.length, self.ready, self.error = set(allowed), length, ready, error
        self.accepted: list[int] = []

    def is_ready(self):
        return self.ready

    def accept_tokens(self, tokens):
        if any(t not in self.allowed for t in tokens):
            return False
        self.accepted += tokens
        return True

    def validate_tokens(self, tokens):
        out = []
        for t in tokens:
            if t not in self.allowed:
                break
            out.append(t)
        return out

    def is_terminated(self):
        return len(self.accepted) >= self.length


def _add(s, rid, n_prompt=5, matcher=None, max_tokens=10):
    s.add_request(
        EngineCoreRequest(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), 0.0, []), matcher
    )


def _run(s, so, token=7, drafts=None):
    ids, toks = [], []
    for rid in so.num_scheduled_tokens:
        req = s.requests[rid]
        ids.append(rid)
        toks.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(ids, toks, spec_token_ids=drafts or {})


def test_compiling_request_waits_and_others_go_ahead():
    s = make_sched()
    m = FakeMatcher(ready=False)
    _add(s, "slow", matcher=m)
    _add(s, "free")
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["free"]
    assert [r.request_id for r in s.waiting] == ["slow"]
    s.update_from_output(so, _run(s, so))
    m.ready = True
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"free", "slow"}


def test_kept_tokens_advance_the_matcher_and_its_end_stops_the_request():
    s = make_sched()
    m = FakeMatcher(length=3)
    _add(s, "c", matcher=m, max_tokens=10)
    finish = None
    for _ in range(10):
        so = s.schedule()
        for o in s.update_from_output(so, _run(s, so)):
            finish = o.finish_reason
        if not s.has_unfinished_requests():
            break
    assert m.accepted == [7, 7, 7] and finish == "stop"
    s.check_integrity()


def test_drafts_cut_to_the_allowed_prefix():
    s = make_sched(num_spec_tokens=3)
    _add(s, "c", matcher=FakeMatcher(allowed={7, 8}, length=99))
    so = s.schedule()
    s.update_from_output(so, _run(s, so, drafts={"c": [8, 9, 8]}))
    assert s.requests["c"].spec_token_ids == [8]


def test_failed_compile_ends_abort_without_leaks():
    s = make_sched()
    _add(s, "bad", matcher=FakeMatcher(error="the schema is wrong"))
    so = s.schedule()
    assert not so.num_scheduled_tokens and "bad" in so.finished_req_ids
    outs = s.update_from_output(so, ModelRunnerOutput([], []))
    assert [(o.request_id, o.finish_reason, o.extra["error"]) for o in outs] == [
        ("bad", "abort", "the schema is wrong")
    ]
    s.check_integrity()


def test_bitmask_rows_only_for_constrained_requests_that_sample():
    s = make_sched(max_num_batched_tokens=8)
    _add(s, "long", n_prompt=20, matcher=FakeMatcher())  # a partial prefill this step: samples nothing
    _add(s, "free", n_prompt=2)
    so = s.schedule()
    assert not bitmask_rows(s.requests, so.num_scheduled_tokens, so.scheduled_spec_decode_tokens).num_rows
    s2 = make_sched()
    m1, m2 = FakeMatcher(), FakeMatcher()
    _add(s2, "a", matcher=m1)
    _add(s2, "b")
    _add(s2, "c", matcher=m2)
    so = s2.schedule()
    rows = bitmask_rows(s2.requests, so.num_scheduled_tokens, {"c": [1, 2]})
    assert rows.first_row == {"a": 0, "c": 1} and rows.num_rows == 4
    assert rows.matchers == [m1, m2] and rows.drafts == [[], [1, 2]]
