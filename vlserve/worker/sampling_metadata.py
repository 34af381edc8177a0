"""SamplingMetadata: one step's per-request sampling options packed into batch tensors.

Built every step by the model runner with `build_sampling_metadata`; read by `Sampler`.
Everything optional is `None` when no row of the batch needs it, so the common cases
(all greedy, no penalties, no logprobs) cost almost nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from vlserve.kernels.host_copy import tensor_to_device, to_device
from vlserve.sampling_params import SamplingParams
from vlserve.worker.logits_adjustment import LogitsAdjustment, build_logits_adjustment


@dataclass
class SamplingMetadata:
    """Batch view of B requests' SamplingParams for one sampling step (row i = request i)."""

    vocab_size: int
    all_greedy: bool  # every row is greedy: sampling is a plain argmax
    all_random: bool  # no row is greedy
    # [B] bool, True for greedy rows; None when all_greedy or all_random.
    is_greedy: torch.Tensor | None
    # [B] float32 temperatures (greedy rows hold 1.0); None when no random row has temperature != 1.
    temperature: torch.Tensor | None
    # Per-row generators of seeded random rows: {row index: generator}. Unseeded rows share one draw.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # [B] int64 top-k (disabled rows hold vocab_size); None when no random row uses top-k.
    top_k: torch.Tensor | None = None
    max_top_k: int | None = None  # the largest top-k below vocab_size (known on the host: no device read)
    # [B] float32 top-p (disabled rows hold 1.0); None when no random row uses top-p.
    top_p: torch.Tensor | None = None
    # [B] float32 min-p (disabled rows hold 0.0); None when no random row uses min-p.
    min_p: torch.Tensor | None = None
    # Penalties: all None when no_penalties.
    no_penalties: bool = True
    presence_penalties: torch.Tensor | None = None  # [B] float32
    frequency_penalties: torch.Tensor | None = None  # [B] float32
    repetition_penalties: torch.Tensor | None = None  # [B] float32
    prompt_mask: torch.Tensor | None = None  # [B, V] bool: token appears in the prompt
    output_counts: torch.Tensor | None = None  # [B, V] float32: occurrences in the output so far
    # min_tokens: logits[ban_rows, ban_token_ids] = -inf (stop tokens of rows still under min_tokens).
    ban_rows: torch.Tensor | None = None  # [N] int64
    ban_token_ids: torch.Tensor | None = None  # [N] int64
    # Largest `logprobs` asked for in the batch; None when no row asked for logprobs.
    max_num_logprobs: int | None = None
    # allowed_token_ids / bad_words / logit_bias of the rows that have them; None when no row does.
    logits_adjustment: LogitsAdjustment | None = None

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator for one seeded request. Create it ONCE per request (at admission) and pass the
    same object every step, so its state advances from step to step."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _token_index(
    rows: list[int], token_lists: list[list[int]], vocab_size: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten token_lists[r] for r in rows into (row index, token id) tensors, dropping out-of-vocab ids."""
    lens = [len(token_lists[r]) for r in rows]
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists[r] for r in rows)), dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64))
    keep = (ids >= 0) & (ids < vocab_size)
    if not bool(keep.all()):
        ids, row_idx = ids[keep], row_idx[keep]
    return to_device(row_idx, device), to_device(ids, device)


def build_sampling_metadata(
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device,
) -> SamplingMetadata:
    """Pack B requests' options into a SamplingMetadata (row i = params[i]).

    generators[i] is request i's persistent generator (seeded requests) or None. prompt_token_ids and
    output_token_ids are only read for rows that need penalties or bad words (and output length for min_tokens).
    """
    B = len(params)
    if not (len(generators) == len(prompt_token_ids) == len(output_token_ids) == B):
        raise ValueError(
            f"build_sampling_metadata: params ({B}), generators ({len(generators)}), prompt_token_ids "
            f"({len(prompt_token_ids)}) and output_token_ids ({len(output_token_ids)}) must have the same length."
        )
    greedy = [p.is_greedy for p in params]
    all_greedy = all(greedy)
    all_random = not any(greedy)
    random_rows = [i for i in range(B) if not greedy[i]]

    md = SamplingMetadata(
        vocab_size=vocab_size,
        all_greedy=all_greedy,
        all_random=all_random,
        is_greedy=None if (all_greedy or all_random) else tensor_to_device(greedy, torch.bool, device),
        temperature=None,
    )

    # Random-sampling options (only meaningful for non-greedy rows).
    if random_rows:
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        if any(t != 1.0 for t in temps):
            md.temperature = tensor_to_device(temps, torch.float32, device)
        top_ks = [
            vocab_size if (g or p.top_k < 1 or p.top_k >= vocab_size) else p.top_k for p, g in zip(params, greedy)
        ]
        if any(k < vocab_size for k in top_ks):
            md.top_k = tensor_to_device(top_ks, torch.int64, device)
            md.max_top_k = max(k for k in top_ks if k < vocab_size)
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        if any(tp < 1.0 for tp in top_ps):
            md.top_p = tensor_to_device(top_ps, torch.float32, device)
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        if any(mp > 0.0 for mp in min_ps):
            md.min_p = tensor_to_device(min_ps, torch.float32, device)
        md.generators = {i: generators[i] for i in random_rows if generators[i] is not None}

    # Penalties: built only for the rows that need them; other rows get neutral values.
    pen_rows = [i for i, p in enumerate(params) if p.needs_penalties]
    if pen_rows:
        md.no_penalties = False
        md.presence_penalties = tensor_to_device([p.presence_penalty for p in params], torch.float32, device)
        md.frequency_penalties = tensor_to_device([p.frequency_penalty for p in params], torch.float32, device)
        md.repetition_penalties = tensor_to_device([p.repetition_penalty for p in params], torch.float32, device)
        prompt_mask = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
        r, t = _token_index(pen_rows, prompt_token_ids, vocab_size, device)
        prompt_mask[r, t] = True
        output_counts = torch.zeros(B, vocab_size, dtype=torch.float32, device=device)
        r, t = _token_index(pen_rows, output_token_ids, vocab_size, device)
        output_counts.index_put_((r, t), torch.ones(r.numel(), dtype=torch.float32, device=device), accumulate=True)
        md.prompt_mask, md.output_counts = prompt_mask, output_counts

    # min_tokens: ban the stop tokens of rows that have not produced min_tokens tokens yet.
    ban_r: list[int] = []
    ban_t: list[int] = []
    for i, p in enumerate(params):
        if p.min_tokens > 0 and len(output_token_ids[i]) < p.min_tokens:
            for tok in p.all_stop_token_ids():
                if 0 <= tok < vocab_size:
                    ban_r.append(i)
                    ban_t.append(tok)
    if ban_r:
        md.ban_rows = tensor_to_device(ban_r, torch.int64, device)
        md.ban_token_ids = tensor_to_device(ban_t, torch.int64, device)

    md.logits_adjustment = build_logits_adjustment(params, output_token_ids, vocab_size, device)
    nums = [p.logprobs for p in params if p.logprobs is not None]
    md.max_num_logprobs = max(nums) if nums else None
    return md
