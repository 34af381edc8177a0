"""Beam search as vLLM runs it, over the ordinary engine: each step every live beam is one request of one token
that asks for the top 2 x beam_width logprobs; the candidates of all beams are ranked by cumulative logprob and the
best beam_width live on. Beams of one prompt share the prompt's KV blocks and each other's through prefix caching,
and the prompt's media through the encoder cache (same mm_hash), so only the last partial block of a beam is
recomputed per step. Pure Python: the drivers (`LLM.beam_search`, the server's `use_beam_search`) run the requests.

Finished beams (EOS, unless `ignore_eos`) are kept aside; at the end the finished and the live beams are ranked by
vLLM's length-penalised score, `cum_logprob / len(tokens) ** length_penalty` (prompt tokens counted, a final EOS
not), and the best beam_width returned, best first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlserve.sampling_params import SamplingParams

MAX_BEAM_WIDTH = 32  # the engine's top-logprobs limit is 2 x this


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool = False  # stop once beam_width beams have finished

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError(
                f"beam search ranks beams by their logprobs and samples nothing: temperature must be "
                f"0, got {self.temperature}"
            )


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt + generated), their cumulative logprob and, once decoded, its text."""

    tokens: list[int]
    cum_logprob: float = 0.0
    num_prompt_tokens: int = 0
    finished: bool = False
    text: str | None = None

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: tuple[int, ...], length_penalty: float) -> float:
    """vLLM's ranking score: cum_logprob / (tokens, a final EOS not counted) ** length_penalty."""
    n = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (n**length_penalty)


@dataclass
class BeamSearch:
    """The beams of one prompt; `step_params()` is what each live beam's one-token request samples with."""

    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: tuple[int, ...]
    live: list[BeamSearchSequence] = field(default_factory=list)
    completed: list[BeamSearchSequence] = field(default_factory=list)
    num_steps: int = 0

    def __post_init__(self) -> None:
        n = len(self.prompt_token_ids)
        self.live = [BeamSearchSequence(list(self.prompt_token_ids), 0.0, n)]

    def step_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.params.beam_width, ignore_eos=True)

    @property
    def done(self) -> bool:
        p = self.params
        return (
            not self.live
            or self.num_steps >= p.max_tokens
            or (p.early_stopping and len(self.completed) >= p.beam_width)
        )

    def advance(self, top_logprobs: list[dict[int, float]]) -> None:
        """One step: `top_logprobs[i]` maps token id -> logprob for live beam i (its top 2 x beam_width)."""
        if len(top_logprobs) != len(self.live):
            raise ValueError(f"{len(top_logprobs)} results for {len(self.live)} live beams")
        candidates = []
        for beam, entry in zip(self.live, top_logprobs):
            for token, logprob in entry.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.cum_logprob + logprob, beam.num_prompt_tokens)
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    new.finished = True
                    self.completed.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)  # one length per step: the score's order
        self.live = candidates[: self.params.beam_width]
        self.num_steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The finished and live beams ranked by `beam_score`, the best beam_width of them."""
        p = self.params
        ranked = sorted(
            self.completed + self.live, key=lambda b: beam_score(b, self.eos_token_ids, p.length_penalty), reverse=True
        )
        return ranked[: p.beam_width]
