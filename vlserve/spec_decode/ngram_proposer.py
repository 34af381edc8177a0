"""N-gram (prompt lookup) drafting: copy what followed an earlier occurrence of the sequence's own suffix.

For each request, with tokens t[0..L-1] (prompt + accepted outputs, no pending drafts):
  * find the longest n in [prompt_lookup_min, prompt_lookup_max] such that the suffix t[L-n:L] also occurs earlier,
    at t[s:s+n] with s + n <= L - 1 (the occurrence is followed by at least one token; it may overlap the suffix);
  * among the occurrences of that n-gram take the EARLIEST one (vLLM v1's choice, its KMP search keeps the
    leftmost longest match; in repetitive text it also leaves the longest continuation). `match="latest"` takes
    the most recent occurrence instead;
  * propose t[s+n : s+n+k]: up to k tokens, fewer when the sequence ends first (or max_model_len is near).
No n-gram of length >= prompt_lookup_min recurs -> no drafts ([]).

Implementation (numpy, whole batch at once, no Python loop over tokens):
  * the batch is one flat int32 array [-1, req0..., -1, req1..., ...]; the -1 separators never equal a token, so a
    match growing backwards dies at its request's start without bounds checks;
  * pass 0 (contiguous, O(total tokens)): candidates = positions e holding their request's last token, except the
    last position itself; when that token is very common, one more contiguous pass (t[e-1] == t[L-2]) thins them;
  * then the match of each surviving candidate is grown one token backwards per round, on the survivors only
    (O(candidates) per round, prompt_lookup_max rounds at most). A request's best match is its earliest (or
    latest) survivor of the last round it still had one in.
Python lists are the slow part (converting 1-2k ints costs ~50-150 us per request), so `propose(..., req_ids=...)`
keeps one growing numpy buffer per request and only appends the new tokens; call `remove_requests` for finished
requests. numpy arrays are used as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from vlserve.worker.proposer import DraftInputs

_DTYPE = np.int32  # token ids < 2**31; half the memory traffic of int64
_SEP = np.full(1, -1, dtype=_DTYPE)


class NgramProposer:
    """`NgramProposer(min_n, max_n, k).propose([tokens_of_req0, tokens_of_req1, ...]) -> [[drafts], ...]`."""

    def __init__(
        self,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        k: int,
        max_model_len: int | None = None,
        match: str = "earliest",
    ):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max ({prompt_lookup_max})"
            )
        if k < 1:
            raise ValueError(f"k (num_speculative_tokens) must be >= 1, got {k}")
        if match not in ("earliest", "latest"):
            raise ValueError(f"match must be 'earliest' or 'latest', got {match!r}")
        self.min_n = int(prompt_lookup_min)
        self.max_n = int(prompt_lookup_max)
        self.k = int(k)
        self.max_model_len = max_model_len  # drafts never run past it (None = no cap)
        self.match = match
        self._buffers: dict[str, list] = {}  # req_id -> [[-1] + tokens buffer, num tokens, last token]

    @classmethod
    def from_config(cls, spec_config, max_model_len: int | None = None) -> NgramProposer:
        return cls(
            spec_config.prompt_lookup_min,
            spec_config.prompt_lookup_max,
            spec_config.num_speculative_tokens,
            max_model_len,
        )

    # -- per-request token buffers (list inputs) ----------------------------------------------------------------
    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Forget the cached token buffers of finished (or preempted) requests."""
        for rid in req_ids:
            self._buffers.pop(rid, None)

    def _buffer_view(self, req_id, tokens: Sequence[int]) -> np.ndarray:
        """[-1, t0, ..., t_{L-1}] for a request whose token list only ever grows by appends (cached)."""
        L = len(tokens)
        entry = self._buffers.get(req_id)
        # entry = [buffer, num tokens held, last token held]; rebuilt when the list shrank or its last known
        # token changed (not the same sequence any more).
        if entry is None or L < entry[1] or (entry[1] > 0 and tokens[entry[1] - 1] != entry[2]):
            buf = np.empty(max(2 * L, 64) + 1, dtype=_DTYPE)
            buf[0] = -1
            buf[1 : L + 1] = tokens
            self._buffers[req_id] = [buf, L, tokens[L - 1] if L else None]
            return buf[: L + 1]
        buf, n = entry[0], entry[1]
        if L > n:
            if L + 1 > buf.shape[0]:
                new = np.empty(2 * (L + 1), dtype=_DTYPE)
                new[: n + 1] = buf[: n + 1]
                buf = entry[0] = new
            if L - n == 1:
                buf[L] = tokens[n]
            else:
                buf[n + 1 : L + 1] = tokens[n:L]
            entry[1], entry[2] = L, tokens[L - 1]
        return buf[: L + 1]

    # -- runner interface (vlserve.worker.proposer.Proposer) ---------------------------------------------------
    uses_target_hidden_states = False
    aux_layer_ids: tuple[int, ...] = ()

    def draft_kv_spec(self) -> None:
        """No KV of its own."""
        return None

    def bind_kv_cache(self, kv_cache) -> None:
        raise TypeError("NgramProposer has no KV cache")

    def propose_drafts(self, inputs: DraftInputs) -> dict[str, list[int]]:
        """Drafts per sampled request from its token ids (the runner's call)."""
        return dict(zip(inputs.req_ids, self.propose(inputs.token_ids, req_ids=inputs.req_ids)))

    # -- proposing ---------------------------------------------------------------------------------------------
    def propose(
        self, token_ids_per_request: Sequence[np.ndarray | Sequence[int]], req_ids: Sequence[str] | None = None
    ) -> list[list[int]]:
        """Drafts (0..k tokens each) for each request's full token sequence (prompt + outputs, no drafts).

        req_ids (optional, same order): lets list inputs use the per-request numpy buffers (see module doc).
        """
        B = len(token_ids_per_request)
        out: list[list[int]] = [[] for _ in range(B)]
        if B == 0:
            return out
        lens = np.fromiter((len(t) for t in token_ids_per_request), dtype=np.int64, count=B)
        room = np.full(B, self.k, dtype=np.int64)  # drafts allowed per request
        if self.max_model_len is not None:
            room = np.minimum(room, self.max_model_len - lens)
        # A request needs an earlier occurrence of a min_n-gram, followed by a token, plus the suffix itself.
        active = np.flatnonzero((lens >= self.min_n + 1) & (room > 0))
        if active.size == 0:
            return out
        pieces = []
        for i in active.tolist():
            t = token_ids_per_request[i]
            if isinstance(t, np.ndarray):
                pieces.append(_SEP)
                pieces.append(t)
            elif req_ids is not None:
                pieces.append(self._buffer_view(req_ids[i], t))
            else:
                pieces.append(_SEP)
                pieces.append(np.asarray(t, dtype=_DTYPE))
        flat = np.concatenate(pieces, dtype=_DTYPE, casting="unsafe")
        lens, room = lens[active], room[active]
        seg = lens + 1  # each request's segment: separator + tokens
        ends = np.cumsum(seg)  # exclusive end of each request's tokens in `flat`
        starts = ends - lens
        last = ends - 1  # flat index of each request's last token
        N = flat.shape[0]

        # Pass 0 (contiguous): positions holding their request's last token (the last position excluded).
        hit = flat == np.repeat(flat[last], seg)
        hit[last] = False
        j = 1
        if self.min_n > 1 and 8 * int(np.count_nonzero(hit)) > N:
            # A very common last token: thin the candidates with one more contiguous pass, t[e-1] == t[L-2].
            hit[1:] &= flat[:-1] == np.repeat(flat[last - 1], seg)[1:]
            j = 2
        src = np.flatnonzero(hit)  # candidate match ends, ascending (so grouped by request)
        if src.size == 0:
            return out
        req = np.searchsorted(starts, src, side="right") - 1
        tgt = last[req]
        best_end = np.full(lens.shape[0], -1, dtype=np.int64)
        best_len = np.zeros(lens.shape[0], dtype=np.int64)
        pick_first = self.match == "earliest"

        def record(n: int) -> None:
            # The survivors all match n tokens; keep the earliest/latest per request.
            if n < self.min_n:
                return
            edge = np.ones(req.shape[0], dtype=bool)
            if pick_first:
                edge[1:] = req[1:] != req[:-1]
            else:
                edge[:-1] = req[:-1] != req[1:]
            r = req[edge]
            best_end[r] = src[edge]
            best_len[r] = n

        record(j)
        while j < self.max_n:
            same = flat[src - j] == flat[tgt - j]
            src, tgt, req = src[same], tgt[same], req[same]
            if src.size == 0:
                break
            j += 1
            record(j)

        found = np.flatnonzero(best_len > 0)
        begin = best_end[found] + 1
        stop = np.minimum(begin + room[found], ends[found])
        for r, b, e in zip(active[found].tolist(), begin.tolist(), stop.tolist()):
            out[r] = flat[b:e].tolist()
        return out
