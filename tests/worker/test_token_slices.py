"""TokenSlices: the sampler's lazy view of each request's prompt / output token ids."""

from vlserve.sampling_params import SamplingParams
from vlserve.worker.request_state import CachedRequestState
from vlserve.worker.sample_step import TokenSlices
from vlserve.worker.sampling_metadata import build_sampling_metadata


def _state(rid, prompt, output, **params):
    return CachedRequestState(rid, list(prompt) + list(output), len(prompt), SamplingParams(**params), None, [], 0)


def test_token_slices_read_like_the_lists_they_stand_for():
    states = [_state("a", [1, 2, 3], [4]), _state("b", [5], [])]
    prompts, outputs = TokenSlices(states, prompt=True), TokenSlices(states, prompt=False)
    assert len(prompts) == len(outputs) == 2
    assert list(prompts) == [[1, 2, 3], [5]] and list(outputs) == [[4], []]
    states[1].token_ids.append(6)  # read when asked, so a token sampled later shows
    assert outputs[1] == [6]


def test_sampling_metadata_from_token_slices_equals_the_one_from_lists():
    states = [
        _state("a", [1, 2, 3], [4, 4], repetition_penalty=1.3, frequency_penalty=0.5),
        _state("b", [5], [6], min_tokens=3, stop_token_ids=[7]),
        _state("c", [8], []),
    ]
    params = [s.sampling_params for s in states]
    lazy = build_sampling_metadata(params, [None] * 3, TokenSlices(states, True), TokenSlices(states, False), 16, "cpu")
    eager = build_sampling_metadata(
        params, [None] * 3, [s.prompt_token_ids for s in states], [s.output_token_ids for s in states], 16, "cpu"
    )
    assert lazy.prompt_mask.equal(eager.prompt_mask) and lazy.output_counts.equal(eager.output_counts)
    assert lazy.output_counts[0, 4] == 2 and lazy.prompt_mask[0, 1]
    assert lazy.ban_rows.tolist() == eager.ban_rows.tolist() == [1]
    assert lazy.ban_token_ids.tolist() == [7]
