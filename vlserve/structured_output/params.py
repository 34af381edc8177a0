"""What a request constrains its output to (pure Python): vLLM's `StructuredOutputsParams` and the engine-wide
`StructuredOutputsConfig` (`--structured-outputs-config`)."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields
from typing import Any

from vlserve.shorten import shorten

# The constraint kinds, in the order vLLM lists them; a request sets exactly one.
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
BACKENDS = ("xgrammar", "guidance")


@dataclass
class StructuredOutputsParams:
    """One output constraint: a JSON schema (`json`, a dict or its JSON text), a `regex`, a `choice` of strings, a
    `grammar` (EBNF as xgrammar reads it, or Lark), any JSON object (`json_object=True`), or a `structural_tag`
    (xgrammar's JSON format). `disable_any_whitespace`: compact JSON (None: the engine's default)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        set_kinds = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            named = ", ".join(set_kinds) if set_kinds else "none"
            raise ValueError(f"structured outputs take exactly one of {', '.join(CONSTRAINT_KINDS)}; got {named}")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured outputs json: the schema is not valid JSON ({e})") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured outputs json must be a JSON schema object, got {shorten(self.json)}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured outputs choice must be a non-empty list of strings")
            if any(not isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured outputs choice must hold strings only, got {shorten(self.choice)}")
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs {name} must be a non-empty string, got {shorten(value)}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured outputs json_object must be true or false, got {shorten(self.json_object)}")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError(
                f"structured outputs structural_tag must be a JSON object or its text, got "
                f"{shorten(self.structural_tag)}"
            )
        if self.disable_any_whitespace not in (None, True, False):
            raise ValueError("structured outputs disable_any_whitespace must be true or false")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        """From a request's dict; a key this class does not know is a ValueError that names it."""
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {shorten(d)}")
        return _from_known_keys(cls, d, "structured_outputs")

    @property
    def kind(self) -> str:
        """Which constraint this is (one of CONSTRAINT_KINDS)."""
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> str:
        """The constraint's text, canonical (JSON with sorted keys), for hashing and compiling."""
        value = getattr(self, self.kind)
        if self.kind == "json_object":
            return ""
        if isinstance(value, (dict, list)):
            return _json.dumps(value, sort_keys=True, ensure_ascii=False)
        if self.kind in ("json", "structural_tag"):
            return _json.dumps(_json.loads(value), sort_keys=True, ensure_ascii=False)
        return value


@dataclass
class StructuredOutputsConfig:
    """Engine-wide structured-output settings (`--structured-outputs-config '{"backend": ...}'`)."""

    backend: str = "xgrammar"  # "xgrammar" or "guidance" (llguidance); "auto" means xgrammar
    disable_any_whitespace: bool = False  # compact JSON unless a request says otherwise
    compile_workers: int = 2  # threads that compile grammars off the step loop

    def __post_init__(self) -> None:
        if self.backend == "auto":
            self.backend = "xgrammar"
        if self.backend not in BACKENDS:
            raise ValueError(
                f"structured outputs backend must be one of {', '.join(BACKENDS)} (or auto), got "
                f"{shorten(self.backend)}"
            )
        if not isinstance(self.compile_workers, int) or self.compile_workers < 1:
            raise ValueError(f"compile_workers must be an integer >= 1, got {shorten(self.compile_workers)}")

    @classmethod
    def from_any(cls, value: StructuredOutputsConfig | dict | str | None) -> StructuredOutputsConfig:
        """From the CLI's JSON text, a dict, an instance or None (defaults); unknown keys are a ValueError."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = _json.loads(value)
        return _from_known_keys(cls, value, "--structured-outputs-config")


def _from_known_keys(cls, d: dict[str, Any], where: str):
    """cls(**d), with a ValueError naming the keys of d that are not fields of cls."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(
            f"{where} has unsupported field(s) {', '.join(unknown)}; supported: {', '.join(sorted(known))}"
        )
    return cls(**d)
