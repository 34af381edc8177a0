"""SpeculativeConfig: the user's `speculative_config` dict, validated (vLLM's key names).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "eagle" | "eagle3", "num_speculative_tokens": 3, "model": "/path/to/draft"}

Every problem raises ValueError naming the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vlserve.demo import default_draft_path

SPEC_METHODS = ("ngram", "eagle", "eagle3")
# vLLM's defaults when neither prompt_lookup_min nor prompt_lookup_max is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass
class SpeculativeConfig:
    """Validated speculative-decoding settings.

    method: "ngram" (prompt lookup, no draft model), "eagle" or "eagle3" (draft head at `model`).
    num_speculative_tokens: drafts proposed per request per step (k >= 1).
    prompt_lookup_min / prompt_lookup_max: n-gram sizes searched (ngram only); a missing one copies the other,
        both missing -> 5/5 (vLLM's defaults).
    model: the draft checkpoint directory (eagle/eagle3 only; not read here, the loader checks it).
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        self._verify()

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """None -> None (spec decode off); a SpeculativeConfig is returned as is; unknown keys are errors."""
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; supported fields are {sorted(known)}")
        return cls(**d)

    @property
    def use_ngram(self) -> bool:
        return self.method == "ngram"

    @property
    def use_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3")

    def _verify(self) -> None:
        method = self.method
        if method is None:
            # vLLM infers the method from the draft model's name; do the same for the obvious cases.
            name = (self.model or "").lower()
            if name in ("ngram", "[ngram]"):
                method = "ngram"
            elif "eagle3" in name:
                method = "eagle3"
            elif "eagle" in name:
                method = "eagle"
            else:
                raise ValueError(f"speculative_config: method is required, one of {list(SPEC_METHODS)}")
        if not isinstance(method, str) or method.lower().strip("[]") not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(SPEC_METHODS)}, got {method!r}")
        self.method = method.lower().strip("[]")

        k = self.num_speculative_tokens
        if k is None:
            raise ValueError("speculative_config: num_speculative_tokens is required (an integer >= 1)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")

        if self.method == "ngram":
            if self.model not in (None, "ngram", "[ngram]"):
                raise ValueError(
                    f"speculative_config: model must not be set for method 'ngram' (it uses no draft "
                    f"model), got {self.model!r}"
                )
            self.model = None
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        else:
            if not isinstance(self.model, str) or not self.model.strip():
                raise ValueError(
                    f"speculative_config: model (the draft checkpoint directory) is required for "
                    f"method {self.method!r}, got {self.model!r}"
                )
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config: {name} only applies to method 'ngram', not {self.method!r}")


def fill_default_draft(speculative_config: Any, target: str | None) -> Any:
    """speculative_config (dict) with model set to the demo EAGLE head when an eagle/eagle3 method names no draft
    and the target is the embedded demo model; anything else is returned unchanged."""
    if not isinstance(speculative_config, dict) or speculative_config.get("model"):
        return speculative_config
    if str(speculative_config.get("method", "")).lower() not in ("eagle", "eagle3"):
        return speculative_config
    draft = default_draft_path(target)
    return {**speculative_config, "model": draft} if draft else speculative_config
