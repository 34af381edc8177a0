"""The runner drives any `Proposer` the same way: it allocates the draft KV from draft_kv_spec(), hands
DraftInputs after each step, and verifies whatever drafts come back (greedy output unchanged)."""

import pytest
import torch

from vlserve import LLM, SamplingParams
from vlserve.worker.proposer import DraftKVSpec


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("proto_qwen2")), arch="qwen2")


class RepeatLastToken:
    """A proposer the runner has never heard of: drafts the last token twice, reads the target's states."""

    uses_target_hidden_states = True
    aux_layer_ids = (1,)

    def __init__(self):
        self.kv = None
        self.calls = []
        self.removed = set()

    def draft_kv_spec(self):
        return DraftKVSpec(block_size=16, num_kv_heads=1, head_dim=4, dtype=torch.float32)

    def bind_kv_cache(self, kv_cache):
        self.kv = kv_cache

    def remove_requests(self, req_ids):
        self.removed.update(req_ids)

    def propose_drafts(self, inputs):
        T = inputs.input_ids.shape[0]
        assert inputs.hidden_states.shape[0] == T and [a.shape[0] for a in inputs.aux_hidden_states] == [T]
        assert inputs.attn_metadata.query_start_loc_cpu[-1] == T
        self.calls.append((list(inputs.req_ids), [list(t) for t in inputs.token_ids]))
        return {rid: [toks[-1]] * 2 for rid, toks in zip(inputs.req_ids, inputs.token_ids)}


def test_runner_calls_an_unknown_proposer(text_model):
    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13] * 4]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = {"dtype": "float32", "num_kv_blocks": 32}
    base = LLM(text_model, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(text_model, **kw)
    proposer = RepeatLastToken()
    llm.engine.runner.set_proposer(proposer)
    assert [tuple(t.shape) for t in proposer.kv] == [(32, 16, 1, 4)] * 2  # allocated by the runner
    runner, bound = llm.engine.runner, proposer.kv
    kv_before = [t for layer in runner.kv_caches for t in layer]
    assert runner.profile_peak_activation_bytes(20) >= 0  # on throwaway caches; the runner's own come back
    assert all(a is b for a, b in zip((t for layer in runner.kv_caches for t in layer), kv_before))
    assert proposer.kv is bound and runner.draft_kv_cache is bound
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [b.outputs[0].token_ids for b in base]
    assert proposer.calls and all(len(ids) == len(toks) for ids, toks in proposer.calls)
    assert proposer.removed == {"__profile__", *(o.request_id for o in out)}  # every finished request
    assert llm.engine.scheduler.stats.spec_num_draft_tokens > 0  # its drafts were verified
    llm.engine.runner.set_proposer(None)
