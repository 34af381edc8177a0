"""Turns the engine core's per-step token outputs into RequestOutputs: detokenize, stop strings, logprobs, n > 1."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vlserve.core.sched_output import EngineCoreOutput
from vlserve.engine.byte_detok import ByteTable
from vlserve.engine.detokenizer import IncrementalDetokenizer
from vlserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from vlserve.sampling_params import SamplingParams


@dataclass
class _SeqState:
    """One engine request (one of a parent's n sequences)."""

    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _ParentState:
    """A user request: prompt, metrics and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    seqs: dict[str, _SeqState]
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # None first: the first token has none

    @property
    def finished(self) -> bool:
        for s in self.seqs.values():
            if s.finish_reason is None:
                return False
        return True


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Engine-side ids of a request's n sequences (the request id itself when n == 1)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Params of sequence `index`: n=1 and, when seeded, seed + index so the n samples differ (`params` itself
    when n is 1)."""
    from dataclasses import replace

    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)


class OutputProcessor:
    """Owns the per-request text state on the front-end side of the engine."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.open_seqs: dict[str, tuple[_ParentState, _SeqState]] = {}  # engine id -> its parent and sequence
        # the tokenizer's per-token bytes when it is a byte-level BPE one (~0.1 s for a 150k vocabulary), else None
        backend = getattr(tokenizer, "_tokenizer", None)
        self.byte_table: ByteTable | None = None if backend is None else ByteTable.build(backend)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> list[str]:
        """Track a request; returns the engine ids of its n sequences."""
        seqs = {}
        for i, cid in enumerate(child_request_ids(request_id, params.n)):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    params.skip_special_tokens,
                    params.stop,
                    params.include_stop_str_in_output,
                    self.byte_table,
                )
            seqs[cid] = _SeqState(
                i,
                params,
                detok,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
        parent = self.parents[request_id] = _ParentState(
            request_id, prompt, prompt_token_ids, RequestMetrics(arrival_time), seqs
        )
        for cid, seq in seqs.items():
            self.open_seqs[cid] = (parent, seq)
        return list(seqs)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], final_only: bool = False
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns the updated RequestOutputs (one per touched parent; with `final_only`
        only those of parents that finished, which skips copying every open sequence each step) and the engine
        ids that hit a stop string, which the caller must finish in the engine core."""
        now = time.time()
        touched: dict[str, _ParentState] = {}
        stop_string_hits: list[str] = []
        open_seq = self.open_seqs.get
        for out in outputs:
            entry = open_seq(out.request_id)
            if entry is None:
                continue
            parent, seq = entry
            if seq.finish_reason is not None:
                continue
            parent.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                parent.kv_transfer_params = out.kv_transfer_params
            if out.prompt_logprobs is not None and parent.prompt_logprobs is None:  # (n > 1: each sequence sends it)
                parent.prompt_logprobs = [None] + [self._logprob_dict(*e) if e else None for e in out.prompt_logprobs]
            metrics, new_ids = parent.metrics, out.new_token_ids
            if metrics.first_token_time is None and new_ids:
                metrics.first_token_time = now
            metrics.last_token_time = now
            seq.token_ids += new_ids
            if out.new_logprobs and seq.logprobs is not None:
                self._append_logprobs(seq, out.new_logprobs)
            stop_str = seq.detok.update(new_ids) if seq.detok is not None else None
            if stop_str is not None and out.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
                stop_string_hits.append(out.request_id)
            elif out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, (stop_str or out.stop_reason)
            elif final_only:
                continue  # a parent finishes only in a step that finishes one of its sequences
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
            elif final_only:
                continue
            results.append(self._make_output(parent))
            if finished:
                self._forget(parent)
        return results, stop_string_hits

    def _append_logprobs(self, seq: _SeqState, new: list) -> None:
        for ids, vals, rank in new:
            seq.logprobs.append(self._logprob_dict(ids, vals, rank))
            seq.cumulative_logprob += vals[0]

    def _logprob_dict(self, ids: list[int], vals: list[float], rank: int) -> dict[int, Logprob]:
        """{token id: Logprob} of one position: ids[0] (the chosen token, with `rank`) then the top ones (rank j)."""
        entry = {}
        for j, (tid, lp) in enumerate(zip(ids, vals)):
            if tid not in entry:
                text = self.tokenizer.decode([tid]) if self.tokenizer is not None else None
                entry[tid] = Logprob(lp, rank if j == 0 else j, text)
        return entry

    def abort(self, request_id: str) -> list[str]:
        """Forget a request (by user id); returns its engine ids so the core can abort them too."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        self._forget(parent)
        return list(parent.seqs)

    def child_ids(self, request_id: str) -> list[str]:
        """Engine ids of an open request's sequences ([] when it is not open)."""
        parent = self.parents.get(request_id)
        return [] if parent is None else list(parent.seqs)

    def finish_aborted(self, request_id: str) -> RequestOutput | None:
        """Mark every open sequence of a request aborted and return its final output."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for seq in parent.seqs.values():
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        parent.metrics.finished_time = time.time()
        self._forget(parent)
        return self._make_output(parent)

    def _forget(self, parent: _ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for cid in parent.seqs:
            self.open_seqs.pop(cid, None)

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def _make_output(self, parent: _ParentState) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.detok.output_text if s.detok is not None else "",
                token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=None if s.logprobs is None else list(s.logprobs),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in parent.seqs.values()
        ]
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            outs,
            parent.finished,
            parent.metrics,
            parent.num_cached_tokens,
            prompt_logprobs=None if parent.prompt_logprobs is None else list(parent.prompt_logprobs),
            kv_transfer_params=parent.kv_transfer_params,
        )
