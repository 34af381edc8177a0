"""The engine with a reasoning parser (offline LLM, tiny Qwen3 checkpoint with think tags): a thinking budget puts
`</think>` right where it is spent, a grammar constrains only what follows it, and the same tokens come out with
async scheduling and with n-gram drafts (which stop before the forced tag); a budget without a parser is refused."""

from __future__ import annotations

import pytest

from vlserve import LLM, SamplingParams

KW = dict(dtype="float32", max_model_len=512, num_kv_blocks=64, block_size=16)
CHOICES = ["alpha", "beta", "gamma"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def thinking_ckpt(tmp_path_factory) -> str:
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("thinking_engine")), arch="qwen3", thinking=True)


def _runs(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, thinking_token_budget=5),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, thinking_token_budget=0),
        SamplingParams(temperature=0, max_tokens=40, thinking_token_budget=4, structured_outputs={"choice": CHOICES}),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, thinking_token_budget=8),  # mid-repeat
    ]
    outs = [llm.generate([prompt], p, use_tqdm=False)[0].outputs[0] for p in params]
    llm.check_integrity()
    return [list(o.token_ids) for o in outs], [o.text for o in outs]


@pytest.fixture(scope="module")
def reference(thinking_ckpt):
    llm = LLM(thinking_ckpt, reasoning_parser="qwen3", **KW)
    try:
        yield llm.get_tokenizer().convert_tokens_to_ids("</think>"), _runs(llm)
    finally:
        llm.shutdown()


def test_budget_and_grammar(reference):
    end, (ids, texts) = reference
    free = ids[3]
    assert end not in free  # random weights do not close their reasoning
    assert ids[0][:5] == free[:5] and ids[0][5] == end and len(ids[0]) == 12
    assert ids[1][0] == end
    assert ids[2][:4] == free[:4] and ids[2][4] == end
    assert texts[2].split("</think>")[1] in CHOICES
    assert ids[4][:8] == free[:8] and ids[4][8] == end


@pytest.mark.parametrize("extra", [{"async_scheduling": True}, {"speculative_config": NGRAM}], ids=["async", "ngram"])
def test_same_tokens_with_async_scheduling_and_drafts(thinking_ckpt, reference, extra):
    llm = LLM(thinking_ckpt, reasoning_parser="qwen3", **KW, **extra)
    try:
        assert _runs(llm) == reference[1]
        if "speculative_config" in extra:
            assert llm.get_metrics()["vlserve:spec_decode_num_draft_tokens_total"] > 0
    finally:
        llm.shutdown()


def test_budget_without_parser_is_refused(thinking_ckpt):
    llm = LLM(thinking_ckpt, **KW)
    try:
        with pytest.raises(ValueError, match="reasoning parser"):
            llm.generate(["hi"], SamplingParams(max_tokens=2, thinking_token_budget=1), use_tqdm=False)
    finally:
        llm.shutdown()


def test_pending_output_takes_the_grammar_or_opens_reasoning(thinking_ckpt):
    """A prompt without think tags leaves the output pending: its first token is the grammar's or `<think>`; either
    way the content the qwen3 parser reads out is one of the choices ("hello\n\n" is a prompt whose greedy pick
    on this checkpoint is `<think>`, then the budget of 2 ends it)."""
    from vlserve.reasoning import get_reasoning_parser

    llm = LLM(thinking_ckpt, reasoning_parser="qwen3", **KW)
    try:
        parser = get_reasoning_parser("qwen3")(llm.get_tokenizer())
        tags = parser.token_ids()
        opened = 0
        for prompt in ("hello", "the quick brown fox", "hello\n\n"):
            constraint = {"choice": CHOICES}
            params = SamplingParams(
                temperature=0, max_tokens=40, thinking_token_budget=2, structured_outputs=constraint
            )
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            ids = out.outputs[0].token_ids
            reasoning, content = parser.extract(out.outputs[0].text, out.prompt_token_ids)
            assert content in CHOICES, (prompt, out.outputs[0].text)
            assert (reasoning is not None) == (ids[0] == tags.start_token_id)
            if ids[0] == tags.start_token_id:
                opened += 1
                assert ids[3] == tags.end_token_id and tags.end_token_id not in ids[:3]
        assert opened >= 1
        llm.check_integrity()
    finally:
        llm.shutdown()
