"""StructuredOutputManager on both backends: compiles run on the pool and are cached (one compile per constraint,
a fresh matcher per request), validate() turns compiler errors into ValueErrors, and grammar_bitmask lays out draft
and bonus rows while leaving every matcher as it found it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.structured_output.walks import DEMO_VOCAB_SIZE, allowed_in_row, mask_row
from vlserve.structured_output.backend import bitmask_words
from vlserve.structured_output.manager import StructuredOutputManager
from vlserve.structured_output.params import StructuredOutputsConfig, StructuredOutputsParams
from vlserve.structured_output.request import StructuredOutputRequest

BACKENDS = ["xgrammar", "guidance"]
ABC = StructuredOutputsParams(regex="abc")
TIMEOUT_S = 30


@pytest.fixture(params=BACKENDS)
def manager(request, demo_tokenizer):
    mgr = StructuredOutputManager(demo_tokenizer, DEMO_VOCAB_SIZE, StructuredOutputsConfig(backend=request.param))
    yield mgr
    mgr.shutdown()


@pytest.fixture
def abc_ids(demo_tokenizer) -> tuple[int, int, int, int]:
    ids = demo_tokenizer.convert_tokens_to_ids(list("abcx"))
    assert demo_tokenizer.decode(ids) == "abcx"
    return tuple(ids)


def gate_compiles(manager) -> tuple[threading.Event, list[str]]:
    """Make the backend's compiles wait for the returned event; the list collects the compiling threads' names."""
    release, threads = threading.Event(), []
    compile_constraint = manager.backend.compile_constraint

    def gated(*args):
        threads.append(threading.current_thread().name)
        assert release.wait(TIMEOUT_S), "the test never released the compile"
        return compile_constraint(*args)

    manager.backend.compile_constraint = gated
    return release, threads


def ready_request(manager, params: StructuredOutputsParams) -> StructuredOutputRequest:
    request = manager.init_request(params)
    request.wait(TIMEOUT_S)
    assert request.is_ready() and request.error is None, request.error
    return request


def expected_row(manager, params: StructuredOutputsParams, tokens: list[int]) -> np.ndarray:
    """The bitmask row of a fresh matcher after tokens (computed without the manager)."""
    grammar = manager.backend.compile(params)
    assert grammar.accept_tokens(tokens)
    return mask_row(grammar, DEMO_VOCAB_SIZE)


def test_init_request_returns_before_the_compile_ends(manager):
    release, threads = gate_compiles(manager)
    request = manager.init_request(ABC)
    assert not request.is_ready() and request.grammar is None and request.error is None
    with pytest.raises(RuntimeError, match="still compiling"):
        request.accept_tokens([1])
    release.set()
    request.wait(TIMEOUT_S)
    assert request.is_ready() and request.grammar is not None and request.error is None
    assert threads and all(name.startswith("vlserve-grammar") for name in threads)
    assert threading.current_thread().name not in threads


def test_compiled_grammars_are_cached_and_matchers_are_not(manager, abc_ids):
    a = abc_ids[0]
    first, second = ready_request(manager, ABC), ready_request(manager, StructuredOutputsParams(regex="abc"))
    assert manager.num_compiles == 1
    assert first.grammar is not second.grammar
    start = mask_row(second.grammar, DEMO_VOCAB_SIZE)
    assert first.accept_tokens([a])
    assert (mask_row(second.grammar, DEMO_VOCAB_SIZE) == start).all()  # its own state
    manager.validate(ABC)
    assert manager.num_compiles == 1
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    ready_request(manager, StructuredOutputsParams(json=schema))
    ready_request(manager, StructuredOutputsParams(json=dict(schema)))
    ready_request(manager, StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert manager.num_compiles == 3  # abc, schema with free whitespace, compact schema


def test_the_same_constraint_compiling_is_shared(manager):
    release, threads = gate_compiles(manager)
    requests = [manager.init_request(ABC) for _ in range(3)]
    assert manager.num_compiles == 1 and not any(r.is_ready() for r in requests)
    release.set()
    for request in requests:
        request.wait(TIMEOUT_S)
    assert len(threads) == 1
    assert len({id(r.grammar) for r in requests}) == 3


def test_a_failed_compile_is_a_request_error(manager):
    request = manager.init_request(StructuredOutputsParams(regex="(ab"))
    request.wait(TIMEOUT_S)
    assert request.is_ready() and request.grammar is None
    assert request.error.startswith("structured outputs regex: ") and "/project/" not in request.error
    with pytest.raises(RuntimeError, match="failed to compile"):
        request.is_terminated()


@pytest.mark.parametrize(
    "params, message",
    [
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "foo"}}}), "foo"),
        (StructuredOutputsParams(regex="(ab"), r"(?i)not closed|unclosed"),
        (StructuredOutputsParams(grammar='root ::= ("a" | "b"'), r"^structured outputs grammar: "),
        (StructuredOutputsParams(grammar='root ::= "a" undefined_rule'), r"undefined_rule"),
        (StructuredOutputsParams(regex=r"[^\s\S]"), "accepts no string"),
    ],
    ids=["bad-schema", "unclosed-paren", "bad-ebnf", "undefined-rule", "regex-matching-nothing"],
)
def test_validate_errors(manager, params, message):
    with pytest.raises(ValueError, match=message):
        manager.validate(params)


def test_validate_accepts_good_constraints(manager):
    for params in (
        ABC,
        StructuredOutputsParams(choice=["x", ""]),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(grammar='start: "yes" | "no"'),
    ):
        manager.validate(params)


def test_grammar_bitmask_rows_and_unchanged_state(manager, abc_ids, demo_tokenizer):
    a, b, c, x = abc_ids
    eos = demo_tokenizer.eos_token_id
    drafted, plain, refused, ended = (ready_request(manager, ABC) for _ in range(4))
    assert ended.accept_tokens([a, b, c])
    requests = [None, drafted, plain, refused, ended]
    drafts = [[5, 6], [a, b], [], [a, x, c], [eos]]
    mask = manager.grammar_bitmask(requests, drafts)
    assert mask.dtype == np.int32 and mask.shape == (3 + 3 + 1 + 4 + 2, bitmask_words(DEMO_VOCAB_SIZE))
    after = {n: expected_row(manager, ABC, [a, b, c][:n]) for n in range(4)}
    expected = [
        -1,
        -1,
        -1,  # unconstrained: two drafts and the bonus row
        after[0],
        after[1],
        after[2],  # a, b drafted: rows at "", "a", "ab"
        after[0],  # no drafts: the bonus row only
        after[0],
        after[1],
        -1,
        -1,  # x refused after "a": its later rows are left open
        after[3],
        -1,
    ]  # "abc" then EOS: the row after EOS is open
    for row, want in enumerate(expected):
        assert (mask[row] == want).all(), f"row {row}: {allowed_in_row(mask[row], DEMO_VOCAB_SIZE)}"
    assert allowed_in_row(mask[11], DEMO_VOCAB_SIZE) == [eos]
    for request, tokens in ((drafted, 0), (plain, 0), (refused, 0), (ended, 3)):
        assert not request.is_terminated()
        assert (mask_row(request.grammar, DEMO_VOCAB_SIZE) == after[tokens]).all()
    assert drafted.accept_tokens([a])
    mask = manager.grammar_bitmask([drafted], [[b]])
    assert (mask[0] == after[1]).all() and (mask[1] == after[2]).all()


def test_grammar_bitmask_checks_its_inputs(manager):
    release, _ = gate_compiles(manager)
    compiling = manager.init_request(StructuredOutputsParams(regex="xyz"))
    with pytest.raises(RuntimeError, match="still compiling"):
        manager.grammar_bitmask([compiling], [[]])
    release.set()
    with pytest.raises(ValueError, match="draft lists"):
        manager.grammar_bitmask([None], [[], []])
    assert manager.grammar_bitmask([], []).shape == (0, bitmask_words(DEMO_VOCAB_SIZE))


def test_shutdown_refuses_new_requests(manager):
    ready_request(manager, ABC)
    manager.shutdown()
    with pytest.raises(RuntimeError):
        manager.init_request(StructuredOutputsParams(regex="new"))
    manager.validate(ABC)  # validate compiles on the caller's thread, so it still works
