"""Rejection sampler: verifies draft tokens against the target model, distribution-exactly (Leviathan et al. 2023).

Layout. For B requests with k_i >= 0 drafts each, the target logits hold sum(k_i + 1) rows, request by request:
rows cu_i .. cu_i + k_i - 1 are the k_i draft positions (row cu_i + j = the target's next-token logits after the
request's tokens + drafts[:j]), row cu_i + k_i is the bonus position (after all k_i drafts). A request with no
drafts has just its bonus row, and is then sampled exactly like the main Sampler would.

Notation: p = the target's next-token distribution at a row AFTER the main sampler's processing (min_tokens bans,
penalties, temperature, min_p, top_k, top_p); q = the draft's distribution at that row (`draft_probs`), or the
one-hot at the draft token when no probabilities are given (n-gram / argmax drafts).

Greedy rows (temperature ~ 0 or top_k == 1): accept draft j while it equals argmax(processed logits); emit the
argmax at the first mismatch, or at the bonus row when every draft matched. Identical to greedy decoding.

Random rows, per draft position j with draft token x, uniform u ~ U[0, 1):
    accept x          iff  u < p(x) / q(x)         (probability min(1, p(x)/q(x)); one-hot q: probability p(x))
    else emit y ~ r,  r(v) = max(p(v) - q(v), 0) / sum_w max(p(w) - q(w), 0)   and stop
    (one-hot q: r = p with x removed, renormalized -- max(p - 1, 0) = 0 at x, p elsewhere)
If all k drafts are accepted, emit a bonus token y ~ p from the bonus row. Why this is exact (one position):
P(emit v) = q(v) min(1, p(v)/q(v)) + P(reject) r(v) = min(q(v), p(v)) + max(p(v) - q(v), 0) = p(v), since
P(reject) = 1 - sum_w min(p(w), q(w)) = sum_w max(p(w) - q(w), 0) is exactly r's normalizer. By induction every
emitted token is distributed as the target would have sampled it given the tokens before it.

Randomness. Per request: k_i uniforms (one per draft position, all drawn up front), then ONE exponential-noise
vector E[V] used to sample the single final token (correction or bonus) as argmax(dist / E) -- the exponential
race, scale-invariant so r needs no normalization. One vector suffices because exactly one final token is drawn
per request and which row it comes from depends only on the uniforms. Seeded requests draw both, in that order,
from their own generator only (so their result does not depend on the rest of the batch; with k_i = 0 they
consume and produce exactly what the main Sampler would); greedy rows draw nothing.

Metadata: one SamplingMetadata row per logits row, built by `build_spec_sampling_metadata` (row cu_i + j sees
output_token_ids + drafts[:j], so penalties and min_tokens bans are exact at every position). A seeded request's
generator is `md.generators[cu_i]` (build_sampling_metadata puts the same generator on each of its rows).

Output: `RejectionSamplerOutput.output_token_ids` [B, max_k + 1] int64, -1 padded: per request the accepted
drafts then the final token (1 .. k_i + 1 tokens). Logprobs, when asked for, are per logits row: the emitted
token number j of request i comes from row cu_i + j.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from vlserve.sampling_params import SamplingParams
from vlserve.worker.sampler import SamplerOutput, compute_target_probs, gather_logprobs, greedy_ids, prepare_logits
from vlserve.worker.sampling_metadata import SamplingMetadata, build_sampling_metadata

PLACEHOLDER_TOKEN_ID = -1

__all__ = [
    "RejectionSampler",
    "RejectionSamplerOutput",
    "rejection_sample_ref",
    "build_spec_sampling_metadata",
    "compute_target_probs",
    "PLACEHOLDER_TOKEN_ID",
]


@dataclass
class RejectionSamplerOutput:
    # [B, max_k + 1] int64: accepted drafts, then the correction/bonus token; PLACEHOLDER_TOKEN_ID (-1) after.
    output_token_ids: torch.Tensor
    num_draft_tokens: list[int]  # k_i per request
    # Per LOGITS ROW (sum(k_i + 1) rows), like SamplerOutput: column 0 = the token emitted from that row (rows
    # past a request's last emitted token hold garbage), columns 1.. = top tokens by raw logprob.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None

    def to_lists(self) -> list[list[int]]:
        """Per request: the emitted tokens (accepted drafts + 1), what ModelRunnerOutput.sampled_token_ids takes."""
        return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in self.output_token_ids.tolist()]

    @property
    def num_accepted(self) -> list[int]:
        return [len(t) - 1 for t in self.to_lists()]


# ------------------------------------------------------------------------------------------------- metadata


def build_spec_sampling_metadata(
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    draft_token_ids: list[list[int]],
    vocab_size: int,
    device,
) -> SamplingMetadata:
    """The per-row SamplingMetadata for `RejectionSampler`: request i contributes k_i + 1 rows, row j of them
    seeing output_token_ids[i] + draft_token_ids[i][:j] (exact penalties and min_tokens bans per position)."""
    r_params, r_gens, r_prompts, r_outputs = [], [], [], []
    for p, g, prompt, out, drafts in zip(
        params, generators, prompt_token_ids, output_token_ids, draft_token_ids, strict=True
    ):
        # Only penalties (counts), bad words (tail) and min_tokens (length) read the outputs; skip copying otherwise.
        needs_outputs = p.reads_output_tokens or p.min_tokens > len(out)
        for j in range(len(drafts) + 1):
            r_params.append(p)
            r_gens.append(g)
            r_prompts.append(prompt)
            r_outputs.append(list(out) + list(drafts[:j]) if (needs_outputs and j) else out)
    return build_sampling_metadata(r_params, r_gens, r_prompts, r_outputs, vocab_size, device)


# ------------------------------------------------------------------------------------------------- layout


@dataclass
class _Layout:
    """Where everything sits. Draft d (flat, request by request) is draft j of request req[d], verified at
    logits row cu[req[d]] + j."""

    T: int
    V: int
    B: int
    num_draft: list[int]  # k_i
    cu: list[int]  # [B + 1] first logits row of each request
    dstart: list[int]  # [B + 1] first flat draft index of each request
    greedy: list[bool]  # per request
    # q over the flat drafts [D, V] float32 (None: every draft one-hot); rows of drafts given without
    # probabilities are materialized one-hot (max(p - onehot_x, 0) is exactly "p without x").
    q: torch.Tensor | None
    q_given: list[bool] | None  # per flat draft: True when its q came from draft_probs


def _layout(
    target_logits: torch.Tensor, draft_token_ids: list[list[int]], draft_probs, md: SamplingMetadata
) -> _Layout:
    T, V = target_logits.shape
    dev = target_logits.device
    num_draft = [len(d) for d in draft_token_ids]
    B, D = len(num_draft), sum(num_draft)
    if D + B != T:
        raise ValueError(
            f"target_logits has {T} rows but {B} requests with {D} drafts need sum(k_i + 1) = "
            f"{D + B} (k_i draft rows + 1 bonus row each)"
        )
    cu, dstart = [0], [0]
    for k in num_draft:
        cu.append(cu[-1] + k + 1)
        dstart.append(dstart[-1] + k)
    if md.all_greedy:
        greedy = [True] * B
    elif md.all_random:
        greedy = [False] * B
    else:
        g = md.is_greedy.tolist()
        greedy = [bool(g[c]) for c in cu[:-1]]

    q, q_given = None, None
    if isinstance(draft_probs, torch.Tensor):
        if tuple(draft_probs.shape) != (D, V):
            raise ValueError(f"draft_probs must be [num_draft_tokens={D}, V={V}], got {tuple(draft_probs.shape)}")
        q, q_given = draft_probs.to(device=dev, dtype=torch.float32), [True] * D
    elif draft_probs is not None:
        if len(draft_probs) != B:
            raise ValueError(f"draft_probs has {len(draft_probs)} entries for {B} requests")
        for i, qi in enumerate(draft_probs):
            if qi is not None and tuple(qi.shape) != (num_draft[i], V):
                raise ValueError(f"draft_probs[{i}] must be [{num_draft[i]}, {V}], got {tuple(qi.shape)}")
        given = [i for i in range(B) if draft_probs[i] is not None and num_draft[i]]
        if given:
            q_given = [draft_probs[i] is not None for i in range(B) for _ in range(num_draft[i])]
            if len(given) == sum(1 for k in num_draft if k):
                q = torch.cat([draft_probs[i] for i in given]).to(device=dev, dtype=torch.float32)
            else:
                q = torch.zeros(D, V, dtype=torch.float32, device=dev)
                rows = torch.tensor([d for i in given for d in range(dstart[i], dstart[i + 1])], device=dev)
                q[rows] = torch.cat([draft_probs[i] for i in given]).to(device=dev, dtype=torch.float32)
                onehot = [d for d, gv in enumerate(q_given) if not gv]
                x = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.int64, device=dev)
                oh = torch.tensor(onehot, device=dev)
                q[oh, x[oh]] = 1.0
    return _Layout(T, V, B, num_draft, cu, dstart, greedy, q, q_given)


def _draw_uniforms_and_noise(
    lay: _Layout, random_reqs: list[int], md: SamplingMetadata, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """u [D]: one uniform per flat draft (only random requests' entries are read); noise [len(random_reqs), V]
    ~ Exp(1), one row per random request. Unseeded requests share one global draw of each; a seeded request
    draws its k_i uniforms and then its noise row from its own generator (md.generators[cu_i]), nothing else."""
    u = torch.rand(lay.dstart[-1], device=device)
    noise = torch.empty(len(random_reqs), lay.V, device=device)
    seeded = [(r, i, md.generators.get(lay.cu[i])) for r, i in enumerate(random_reqs)]
    seeded = [s for s in seeded if s[2] is not None]
    if len(seeded) < len(random_reqs):
        noise.exponential_()
    for r, i, g in seeded:
        if lay.num_draft[i]:
            u[lay.dstart[i] : lay.dstart[i + 1]] = torch.rand(lay.num_draft[i], generator=g, device=device)
        noise[r].exponential_(generator=g)
    # exponential_ can in principle return 0; keep 0-probability tokens at 0 instead of NaN (as the Sampler).
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return u, noise


def _accept(u: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor | None) -> torch.Tensor:
    """Leviathan acceptance: u < p(x)/q(x), i.e. probability min(1, p(x)/q(x)); one-hot q (None): u < p(x).
    q(x) == 0 (x could not have been drafted from q): accept iff p(x) > 0."""
    if q_x is None:
        return u < p_x
    ratio = torch.where(
        q_x > 0, p_x / q_x.clamp(min=torch.finfo(q_x.dtype).tiny), torch.where(p_x > 0, float("inf"), 0.0)
    )
    return u < ratio


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Unnormalized r = max(p - q, 0) per row (q None: p with the draft token x zeroed). A row with no mass left
    (p == q up to rounding, where rejection has probability ~0) falls back to p."""
    if q is None:
        r = p.scatter(1, x.unsqueeze(1), 0.0)
    else:
        r = (p - q).clamp_(min=0.0)
    empty = r.sum(dim=1, keepdim=True) <= 0
    return torch.where(empty, p, r)


def _finish(out_tokens: torch.Tensor, lay: _Layout, raw_logprobs, md: SamplingMetadata) -> RejectionSamplerOutput:
    out = RejectionSamplerOutput(output_token_ids=out_tokens, num_draft_tokens=lay.num_draft)
    if raw_logprobs is not None:
        # Row cu_i + j emitted token j of request i (rows past the last emitted token: placeholder -> 0).
        dev = out_tokens.device
        req = torch.repeat_interleave(torch.arange(lay.B), torch.tensor([k + 1 for k in lay.num_draft])).to(dev)
        pos = torch.arange(lay.T, device=dev) - torch.tensor(lay.cu[:-1], device=dev)[req]
        row_tokens = out_tokens[req, pos].clamp(min=0)
        so = SamplerOutput(sampled_token_ids=row_tokens)
        gather_logprobs(raw_logprobs, row_tokens, md.max_num_logprobs, so)
        out.logprob_token_ids, out.logprobs, out.sampled_ranks = so.logprob_token_ids, so.logprobs, so.sampled_ranks
    return out


# ------------------------------------------------------------------------------------------------- fast path


class RejectionSampler:
    """Stateless; `RejectionSampler()(target_logits, draft_token_ids, draft_probs, md)`.

    target_logits: [sum(k_i + 1), V] (float32, or anything .float() takes), layout in the module doc.
    draft_token_ids: per request, its k_i drafts (k_i may be 0).
    draft_probs: None (all one-hot), a list with per request None or [k_i, V] q, or one [sum(k_i), V] tensor.
        q must be the distribution the drafts were actually sampled from (after the draft's own temperature etc.)
        over the target's vocabulary.
    md: per-row SamplingMetadata from `build_spec_sampling_metadata`.
    Returns RejectionSamplerOutput; `.to_lists()` gives per request accepted drafts + 1 token.
    """

    def __call__(self, target_logits, draft_token_ids, draft_probs, md) -> RejectionSamplerOutput:
        return self.forward(target_logits, draft_token_ids, draft_probs, md)

    def forward(
        self, target_logits: torch.Tensor, draft_token_ids: list[list[int]], draft_probs, md: SamplingMetadata
    ) -> RejectionSamplerOutput:
        lay = _layout(target_logits, draft_token_ids, draft_probs, md)
        B, T, D = lay.B, lay.T, lay.dstart[-1]
        dev = target_logits.device
        max_k = max(lay.num_draft, default=0)
        logits, raw_logprobs = prepare_logits(target_logits, md)

        # Index bookkeeping as tensors (no per-request Python work beyond flattening the draft lists).
        k = torch.tensor(lay.num_draft, dtype=torch.int64, device=dev)  # [B]
        cu = torch.tensor(lay.cu, dtype=torch.int64, device=dev)  # [B + 1]
        dstart = torch.tensor(lay.dstart, dtype=torch.int64, device=dev)  # [B + 1]
        req_ids = torch.arange(B, device=dev)
        row_req = torch.repeat_interleave(req_ids, k + 1)  # [T] request of each logits row
        d_req = torch.repeat_interleave(req_ids, k)  # [D] request of each flat draft
        d_pos = torch.arange(D, device=dev) - dstart[d_req]  # [D] its position j
        d_row = cu[d_req] + d_pos  # [D] its logits row
        x_all = torch.tensor(list(itertools.chain.from_iterable(draft_token_ids)), dtype=torch.int64, device=dev)
        greedy_req = torch.tensor(lay.greedy, dtype=torch.bool, device=dev)  # [B]
        accepted = torch.zeros(B, max_k, dtype=torch.bool, device=dev)
        final = torch.empty(B, dtype=torch.int64, device=dev)
        any_greedy, any_random = any(lay.greedy), not all(lay.greedy)

        # ---- greedy requests: accept while draft == argmax of the processed logits.
        if any_greedy:
            argmax = greedy_ids(logits) if md.all_greedy else torch.zeros(T, dtype=torch.int64, device=dev)
            if not md.all_greedy:
                g_rows = greedy_req[row_req].nonzero(as_tuple=True)[0]
                argmax[g_rows] = greedy_ids(logits.index_select(0, g_rows))
            g_d = greedy_req[d_req].nonzero(as_tuple=True)[0]
            if g_d.numel():
                accepted[d_req[g_d], d_pos[g_d]] = argmax[d_row[g_d]] == x_all[g_d]

        # ---- random requests: accept draft x with probability min(1, p(x)/q(x)).
        if any_random:
            r_reqs = [i for i in range(B) if not lay.greedy[i]]
            if md.all_random:
                p = compute_target_probs(logits, md)  # [T, V]
                row_in_p = torch.arange(T, device=dev)
            else:
                r_rows = (~greedy_req[row_req]).nonzero(as_tuple=True)[0]
                p = compute_target_probs(logits, md, r_rows)  # [num random rows, V]
                row_in_p = torch.zeros(T, dtype=torch.int64, device=dev)
                row_in_p[r_rows] = torch.arange(r_rows.numel(), device=dev)
            u, noise = _draw_uniforms_and_noise(lay, r_reqs, md, dev)
            r_d = (~greedy_req[d_req]).nonzero(as_tuple=True)[0]
            if r_d.numel():
                x = x_all[r_d]
                p_x = p[row_in_p[d_row[r_d]], x]
                q_x = None if lay.q is None else lay.q[r_d, x]
                accepted[d_req[r_d], d_pos[r_d]] = _accept(u[r_d], p_x, q_x)

        # ---- accepted drafts per request m_i = length of the all-accepted prefix.
        if max_k:
            m = accepted.to(torch.int32).cumprod(dim=1).sum(dim=1).to(torch.int64)
        else:
            m = torch.zeros(B, dtype=torch.int64, device=dev)

        # ---- the final token of each request, from logits row cu_i + m_i.
        f_row = cu[:-1] + m  # [B]
        if any_greedy:
            gi = greedy_req.nonzero(as_tuple=True)[0]
            final[gi] = argmax[f_row[gi]]
        if any_random:
            ri = torch.tensor(r_reqs, dtype=torch.int64, device=dev)
            dist = p[row_in_p[f_row[ri]]]  # [R, V] copy: p at the final row (bonus: y ~ p)
            rejected = m[ri] < k[ri]
            if bool(rejected.any()):
                # Rejected at draft m_i: y ~ norm(max(p - q, 0)) (one-hot q: p without the draft token).
                rej_r = rejected.nonzero(as_tuple=True)[0]
                rej_d = dstart[ri[rej_r]] + m[ri[rej_r]]  # flat index of the rejected draft
                dist[rej_r] = _residual(dist[rej_r], None if lay.q is None else lay.q[rej_d], x_all[rej_d])
            # Exponential race: argmax(dist / E) samples from dist / sum(dist) (no normalization needed).
            final[ri] = greedy_ids(dist.div_(noise))

        # ---- [B, max_k + 1]: drafts[:m_i], final at m_i, -1 after.
        out = torch.full((B, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=dev)
        if D:
            keep = d_pos < m[d_req]
            out[d_req[keep], d_pos[keep]] = x_all[keep]
        out.scatter_(1, m.unsqueeze(1), final.unsqueeze(1))
        return _finish(out, lay, raw_logprobs, md)


# ------------------------------------------------------------------------------------------------- reference


def rejection_sample_ref(
    target_logits: torch.Tensor, draft_token_ids: list[list[int]], draft_probs, md: SamplingMetadata
) -> RejectionSamplerOutput:
    """The same algorithm as a plain per-request, per-position loop, with the same random draws (so it
    reproduces `RejectionSampler` exactly, seeded or not, given the same global RNG state). For tests."""
    lay = _layout(target_logits, draft_token_ids, draft_probs, md)
    dev = target_logits.device
    logits, raw_logprobs = prepare_logits(target_logits, md)
    r_reqs = [i for i in range(lay.B) if not lay.greedy[i]]
    P = compute_target_probs(logits, md) if r_reqs else None  # every row; only random rows are read
    u, noise = _draw_uniforms_and_noise(lay, r_reqs, md, dev) if r_reqs else (None, None)
    max_k = max(lay.num_draft, default=0)
    out = torch.full((lay.B, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=dev)
    for i in range(lay.B):
        k, drafts, emitted = lay.num_draft[i], draft_token_ids[i], []
        if lay.greedy[i]:
            for j in range(k + 1):
                t = int(logits[lay.cu[i] + j].argmax())
                emitted.append(t)  # == the draft when it matches; the correction / bonus token otherwise
                if j == k or drafts[j] != t:
                    break
        else:
            E = noise[r_reqs.index(i)]
            for j in range(k + 1):
                p = P[lay.cu[i] + j]  # target probabilities after this request's first j drafts
                if j == k:  # every draft accepted: bonus token y ~ p
                    emitted.append(int((p / E).argmax()))
                    break
                d = lay.dstart[i] + j
                x = drafts[j]
                one_hot = lay.q is None or not lay.q_given[d]
                q = None if one_hot else lay.q[d]
                ratio = (
                    p[x] if one_hot else (p[x] / q[x] if q[x] > 0 else torch.tensor(float("inf") if p[x] > 0 else 0.0))
                )
                if u[d] < ratio:  # accept x with probability min(1, p(x)/q(x))
                    emitted.append(x)
                    continue
                # rejected: y ~ norm(max(p - q, 0)); for one-hot q that is p with x removed
                if one_hot:
                    r = p.clone()
                    r[x] = 0.0
                else:
                    r = (p - q).clamp(min=0.0)
                if r.sum() <= 0:
                    r = p
                emitted.append(int((r / E).argmax()))
                break
        out[i, : len(emitted)] = torch.tensor(emitted, dtype=torch.int64)
    return _finish(out, lay, raw_logprobs, md)
