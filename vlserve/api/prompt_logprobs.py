"""`prompt_logprobs` in responses, as vLLM returns them: per prompt token None (the first) or {token id: {logprob,
rank, decoded_token}}; -inf becomes -9999.0 (JSON has no infinity)."""

from __future__ import annotations

import math

from vlserve.api.protocol import PromptLogprob
from vlserve.outputs import Logprob

_FLOOR = -9999.0


def prompt_logprobs_body(
    entries: list[dict[int, Logprob] | None] | None,
) -> list[dict[int, PromptLogprob] | None] | None:
    """The response field from RequestOutput.prompt_logprobs (None when the request asked for none)."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            tid: PromptLogprob(
                logprob=lp.logprob if math.isfinite(lp.logprob) else _FLOOR,
                rank=lp.rank,
                decoded_token=lp.decoded_token,
            )
            for tid, lp in entry.items()
        }
        for entry in entries
    ]
