"""The reasoning parsers on strings and streamed deltas: where reasoning starts and ends, tags split across deltas,
the prompt's last tag, and streaming equal to the whole-text split over every way of cutting the text."""

from __future__ import annotations

import pytest

from vlserve.reasoning import ReasoningState, get_reasoning_parser, reasoning_parser_names


class TagTokenizer:
    """Encodes each tag as one id and every other character as its own id (enough for the parsers' needs)."""

    IDS = {"<think>": 1000, "</think>": 1001}

    def encode(self, text, add_special_tokens=False):
        return [self.IDS[text]] if text in self.IDS else [ord(c) for c in text]


OPEN_PROMPT = [5, 1000, 6]  # ... <think> \n
CLOSED_PROMPT = [5, 1000, 1001, 6]  # ... <think></think> \n (enable_thinking false)
PLAIN_PROMPT = [5, 6]


def parser(name):
    return get_reasoning_parser(name)(TagTokenizer())


def test_registry_lists_and_refuses():
    assert {"qwen3", "deepseek_r1"} <= set(reasoning_parser_names())
    with pytest.raises(ValueError, match="unknown reasoning parser.*qwen3"):
        get_reasoning_parser("nope")


def test_a_tag_that_is_not_one_token_is_refused():
    class Chars:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    with pytest.raises(ValueError, match="one token"):
        get_reasoning_parser("qwen3")(Chars())


@pytest.mark.parametrize(
    "name, prompt, text, expected",
    [
        ("qwen3", PLAIN_PROMPT, "<think>plan</think>answer", ("plan", "answer")),
        ("qwen3", PLAIN_PROMPT, "answer only", (None, "answer only")),
        ("qwen3", PLAIN_PROMPT, "answer</think>more", (None, "answer</think>more")),
        ("qwen3", PLAIN_PROMPT, "<think>cut off", ("cut off", None)),
        ("qwen3", OPEN_PROMPT, "plan</think>answer", ("plan", "answer")),
        ("qwen3", OPEN_PROMPT, "still thinking", ("still thinking", None)),
        ("qwen3", CLOSED_PROMPT, "<think>x</think>y", (None, "<think>x</think>y")),
        ("qwen3", None, "<think></think>answer", ("", "answer")),
        ("deepseek_r1", PLAIN_PROMPT, "plan</think>answer", ("plan", "answer")),
        ("deepseek_r1", PLAIN_PROMPT, "<think>plan</think>answer", ("plan", "answer")),
        ("deepseek_r1", PLAIN_PROMPT, "no end tag", ("no end tag", None)),
        ("deepseek_r1", CLOSED_PROMPT, "answer", (None, "answer")),
        ("deepseek_r1", None, "a</think>b</think>c", ("a", "b</think>c")),
    ],
)
def test_extract(name, prompt, text, expected):
    assert parser(name).extract(text, prompt) == expected


def test_initial_state_follows_the_last_tag_of_the_prompt():
    qwen3, r1 = parser("qwen3"), parser("deepseek_r1")
    assert qwen3.initial_state(OPEN_PROMPT) is ReasoningState.REASONING
    assert qwen3.initial_state(CLOSED_PROMPT) is ReasoningState.ENDED
    assert qwen3.initial_state(PLAIN_PROMPT) is ReasoningState.PENDING
    assert r1.initial_state(PLAIN_PROMPT) is ReasoningState.REASONING
    assert qwen3.is_reasoning_end(OPEN_PROMPT + [7, 1001]) and not qwen3.is_reasoning_end(OPEN_PROMPT)
    assert qwen3.num_reasoning_tokens([7, 8, 1001, 9], OPEN_PROMPT) == 2
    assert qwen3.num_reasoning_tokens([1000, 7, 1001, 9], PLAIN_PROMPT) == 1
    assert qwen3.num_reasoning_tokens([7, 1000, 8], PLAIN_PROMPT) == 0  # no leading <think>: content
    assert r1.num_reasoning_tokens([7, 8, 9], PLAIN_PROMPT) == 3


def stream_split(p, prompt, pieces):
    stream = p.new_stream(prompt)
    reasoning, content = [], []
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, finished=i == len(pieces) - 1)
        reasoning.append(r or "")
        content.append(c or "")
    return "".join(reasoning), "".join(content), stream.reasoned


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize(
    "prompt, text",
    [
        (PLAIN_PROMPT, "<think>a plan</think>the answer"),
        (OPEN_PROMPT, "a plan</think>the answer"),
        (PLAIN_PROMPT, "plain <thin text"),
        (PLAIN_PROMPT, "<think>unfinished </thi"),
        (CLOSED_PROMPT, "content <think>"),
    ],
)
def test_streaming_equals_extract_over_every_cut(name, prompt, text):
    p = parser(name)
    reasoning, content = p.extract(text, prompt)
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            r, c, reasoned = stream_split(p, prompt, [text[:a], text[a:b], text[b:]])
            assert (r if reasoned else None, c or None) == (reasoning, content), (a, b)


def test_partial_tags_are_held_back_until_told():
    stream = parser("qwen3").new_stream(OPEN_PROMPT)
    assert stream.feed("plan</th") == ("plan", None)
    assert stream.feed("ink>ans") == (None, "ans")
    stream = parser("qwen3").new_stream(OPEN_PROMPT)
    assert stream.feed("a </") == ("a ", None)
    assert stream.feed("b") == ("</b", None)  # not the tag after all
    pending = parser("qwen3").new_stream(PLAIN_PROMPT)
    assert pending.feed("<thi") == (None, None)
    assert pending.feed("s is text") == (None, "<this is text")
