"""Default sampling parameters from a checkpoint's generation_config.json (vLLM's `--generation-config`).

`auto` reads the model directory's generation_config.json (none there: the built-in defaults), `vlserve` keeps the
built-in defaults, any other value is a directory whose generation_config.json is read. As vLLM does, the keys taken
are repetition_penalty, temperature, top_k, top_p, min_p and max_new_tokens (as max_tokens), as transformers'
`GenerationConfig.to_diff_dict()` gives them; `do_sample` is not read. A request's own (non-null) fields win; an
unset max_tokens is capped by the default (the smaller of it and the endpoint's own default).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from vlserve.sampling_params import SamplingParams
from vlserve.shorten import shorten

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
BUILTIN = "vlserve"
_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
_REQUEST_ALIASES = {"max_completion_tokens": "max_tokens"}  # request field -> the SamplingParams field it sets


@dataclass(frozen=True)
class GenerationDefaults:
    """SamplingParams field -> default value, and where they came from (a generation_config.json, or "vlserve")."""

    values: dict[str, Any] = field(default_factory=dict)
    source: str = BUILTIN

    def describe(self) -> str:
        """One line for the start-up log."""
        if not self.values:
            return f"default sampling parameters: vlserve's built-in ones (source: {self.source})"
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return (
            f"default sampling parameters from {self.source}: {shown} (a request's own fields win; "
            f"--generation-config {BUILTIN} turns these off)"
        )

    def sampling_params(self) -> SamplingParams:
        """SamplingParams() with these defaults (what `LLM.generate` uses when given none)."""
        return SamplingParams(**self.values)

    def apply(self, params: SamplingParams, given: Collection[str]) -> SamplingParams:
        """`params` with each default whose field is not in `given` (the SamplingParams fields the request set)."""
        updates = {}
        for name, value in self.values.items():
            if name in given:
                continue
            if name == "max_tokens" and params.max_tokens is not None:
                value = min(value, params.max_tokens)
            updates[name] = value
        return replace(params, **updates) if updates else params

    def apply_to_request(self, params: SamplingParams, request: Any) -> SamplingParams:
        """`apply` for a pydantic request body: the fields it sent with a non-null value are its own."""
        given = {_REQUEST_ALIASES.get(k, k) for k in request.model_fields_set if getattr(request, k, None) is not None}
        return self.apply(params, given)


def load_generation_defaults(setting: str, model_path: str) -> GenerationDefaults:
    """The defaults `setting` ("auto", "vlserve" or a directory) names for the checkpoint at `model_path`;
    ValueError for a directory without a readable generation_config.json or with values SamplingParams refuses."""
    if setting == BUILTIN:
        return GenerationDefaults(source=f"--generation-config {BUILTIN}")
    if setting == "auto":
        folder = model_path
        if not os.path.isfile(os.path.join(folder, GENERATION_CONFIG_FILE)):
            return GenerationDefaults(source=f"no {GENERATION_CONFIG_FILE} in the checkpoint")
    else:
        folder = os.path.expanduser(setting)
        if not os.path.isfile(os.path.join(folder, GENERATION_CONFIG_FILE)):
            raise ValueError(
                f"--generation-config {shorten(setting)}: no {GENERATION_CONFIG_FILE} in that directory (give "
                f"auto, {BUILTIN} or a directory holding {GENERATION_CONFIG_FILE})"
            )
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(folder).to_diff_dict()
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    values = {("max_tokens" if k == "max_new_tokens" else k): config[k] for k in _KEYS if config.get(k) is not None}
    try:
        SamplingParams(**values)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path} holds sampling values vlserve cannot use: {e}") from None
    return GenerationDefaults(values, source=path)
