"""Pooling requests' parameters (`PoolingParams`) and the engine's pooler settings (`PoolerConfig`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

POOLING_TASKS = ("embed", "classify", "score", "encode")
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
RUNNER_TYPES = ("auto", "generate", "pooling")
CONVERT_TYPES = ("auto", "none", "embed", "classify")


@dataclass
class PoolingParams:
    """What a pooling request asks: its task, a Matryoshka truncation (`dimensions`), whether to L2-normalize the
    embedding (`normalize`, default: the pooler's) and whether to apply the classifier's activation (`activation`:
    softmax over several labels, sigmoid over one; default on)."""

    task: str = "embed"  # embed | classify | score | encode
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None

    def verify(self) -> None:
        """ValueError on a field out of range (the engine checks `dimensions` against the model)."""
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {d!r}")
        if d is not None and self.task not in ("embed", "encode"):
            raise ValueError(f"dimensions applies to embeddings only, not to task {self.task!r}")
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true, false or null, got {value!r}")


@dataclass
class PoolerConfig:
    """The engine's pooler: how token hidden states become one vector (`pooling_type`), whether embeddings are
    L2-normalized by default, and for a classifier made from a generative checkpoint the tokens whose LM-head rows
    score it (`classifier_from_token`: one token -> its logit, ["no", "yes"] -> logit(yes) - logit(no))."""

    pooling_type: str | None = None  # LAST | MEAN | CLS | ALL (None: the checkpoint's, else LAST)
    normalize: bool | None = None  # None: True for embed, False otherwise
    classifier_from_token: list[str] | None = None

    @classmethod
    def from_any(cls, value) -> PoolerConfig:
        """From None, a dict, JSON text or a PoolerConfig; ValueError on unknown keys or values."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown pooler_config keys {unknown}; known: {sorted(known)}")
        config = cls(**value)
        if config.pooling_type is not None:
            config.pooling_type = str(config.pooling_type).upper()
            if config.pooling_type not in POOLING_TYPES:
                raise ValueError(
                    f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {value['pooling_type']!r}"
                )
        if config.normalize is not None and not isinstance(config.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {config.normalize!r}")
        tokens = config.classifier_from_token
        if tokens is not None and (
            not isinstance(tokens, list) or len(tokens) not in (1, 2) or not all(isinstance(t, str) for t in tokens)
        ):
            raise ValueError(f"classifier_from_token must be a list of one or two token strings, got {tokens!r}")
        return config


def check_runner_args(runner: str, convert: str) -> None:
    """ValueError on an unknown `runner` / `convert`, or a conversion asked of a generation runner."""
    if runner not in RUNNER_TYPES:
        raise ValueError(f"runner must be one of {', '.join(RUNNER_TYPES)}, got {runner!r}")
    if convert not in CONVERT_TYPES:
        raise ValueError(f"convert must be one of {', '.join(CONVERT_TYPES)}, got {convert!r}")
    if runner == "generate" and convert in ("embed", "classify"):
        raise ValueError(f"convert={convert!r} makes a pooling model: use runner='pooling' (or 'auto')")


@dataclass(frozen=True)
class PoolerSpec:
    """A pooling engine's resolved pooler (plain data, sent to every rank): the pooling over the prompt's final
    hidden states, the default normalization, and the head after it (`task` "embed": none; "classify": the rows
    of `classifier_token_ids` in the LM head, two ids scoring logit(second) - logit(first))."""

    pooling_type: str = "LAST"
    normalize: bool = True
    task: str = "embed"  # embed | classify
    classifier_token_ids: tuple[int, ...] = ()
    matryoshka_dimensions: tuple[int, ...] | None = None  # the truncations the model was trained for (None: any)
    is_matryoshka: bool = False

    @property
    def supported_tasks(self) -> set[str]:
        """The PoolingParams tasks this engine serves."""
        return {"embed", "encode"} if self.task == "embed" else {"classify", "score", "encode"}


HF_OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker")


def apply_hf_overrides(overrides, convert: str, pooler_config: PoolerConfig) -> tuple[str, PoolerConfig]:
    """vLLM's reranker `--hf-overrides` as (convert, pooler_config): `architectures` naming a
    `*ForSequenceClassification` means convert="classify", `classifier_from_token` goes to the pooler config,
    `is_original_qwen3_reranker` asks for its two tokens (["no", "yes"]). ValueError on any other key."""
    if overrides is None:
        return convert, pooler_config
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as e:
            raise ValueError(f"hf_overrides is not valid JSON: {e}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object, got {type(overrides).__name__}")
    unknown = sorted(set(overrides) - set(HF_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"hf_overrides keys {unknown} are not supported; supported: {list(HF_OVERRIDE_KEYS)}")
    archs = overrides.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or len(archs) != 1 or not str(archs[0]).endswith("ForSequenceClassification"):
            raise ValueError(f"hf_overrides architectures must name one *ForSequenceClassification, got {archs!r}")
        if convert not in ("auto", "classify"):
            raise ValueError(f"hf_overrides architectures {archs[0]} contradicts convert={convert!r}")
        convert = "classify"
    tokens = overrides.get("classifier_from_token")
    if tokens is not None:
        pooler_config = PoolerConfig.from_any({**pooler_config.__dict__, "classifier_from_token": tokens})
    if overrides.get("is_original_qwen3_reranker") and len(pooler_config.classifier_from_token or ()) != 2:
        raise ValueError('is_original_qwen3_reranker needs classifier_from_token with two tokens (["no", "yes"])')
    return convert, pooler_config
