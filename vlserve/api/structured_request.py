"""A request's output constraint -> `StructuredOutputsParams` (one per request, whichever field carries it).

Fields read (chat and completions alike):
- `structured_outputs` (vLLM's): {json | regex | choice | grammar | json_object | structural_tag,
  disable_any_whitespace, disable_fallback (no effect), whitespace_pattern (as guided_whitespace_pattern)}; any
  other key is a 400 naming it. Given with no constraint of its own, its options apply
  to the constraint another field sets (e.g. response_format); with none anywhere it is a 400.
- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object),
  {"type": "json_schema", "json_schema": {"name", "schema", "description"?, "strict"?}} (`schema` required, as in
  vLLM), {"type": "structural_tag", ...} (the whole object goes to xgrammar as the structural tag).
- the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and top-level `structural_tag`;
  `guided_decoding_backend` is accepted when it names this server's backend (or "auto"), with the options
  "disable-any-whitespace" and "no-fallback"; `guided_whitespace_pattern` is a 400 with a JSON constraint (xgrammar
  cannot take a pattern; `disable_any_whitespace` is what it offers).
- a tool_choice of "required" or a named function (its JSON schema, from vlserve.api.tool_choice).
Two constraints in one request are a 400 naming both. Compiling is the engine's business (its errors are 400s too).
"""

from __future__ import annotations

from typing import Any

from vlserve.shorten import shorten
from vlserve.structured_output.params import CONSTRAINT_KINDS, StructuredOutputsParams

OPTION_KEYS = ("disable_any_whitespace",)
# vLLM's other keys: disable_fallback changes nothing here (there is no fallback backend); whitespace_pattern is
# checked like guided_whitespace_pattern
_OTHER_KEYS = ("disable_fallback", "whitespace_pattern")
GUIDED_FIELDS = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
    ("structural_tag", "structural_tag"),
)
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
_JSON_SCHEMA_KEYS = ("name", "schema", "description", "strict")
_BACKEND_OPTIONS = ("disable-any-whitespace", "no-fallback")

Source = tuple[str, str, Any]  # (the request field that set it, constraint kind, value)


def _structured_outputs_sources(value: Any) -> tuple[list[Source], dict[str, Any]]:
    """The constraints and the options of a `structured_outputs` object."""
    if value is None:
        return [], {}
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs must be an object, got {shorten(value)}")
    known = CONSTRAINT_KINDS + OPTION_KEYS + _OTHER_KEYS
    unknown = [k for k in value if k not in known]
    if unknown:
        raise ValueError(
            f"structured_outputs: unsupported field(s) {', '.join(shorten(k) for k in unknown[:5])}; "
            f"supported: {', '.join(known)}"
        )
    sources = [
        (f"structured_outputs.{k}", k, value[k])
        for k in CONSTRAINT_KINDS
        if value.get(k) is not None and value.get(k) is not False
    ]
    options = {k: value[k] for k in OPTION_KEYS if value.get(k) is not None}
    return sources, options


def _refuse_keys(where: str, value: dict, allowed: tuple[str, ...]) -> None:
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise ValueError(
            f"{where}: unsupported field(s) {', '.join(shorten(k) for k in unknown[:5])}; "
            f"supported: {', '.join(allowed)}"
        )


def _response_format_source(value: Any) -> Source | None:
    """The constraint a `response_format` object sets (None for type "text")."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"response_format must be an object, got {shorten(value)}")
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {shorten(kind)}")
    if kind == "structural_tag":
        return "response_format structural_tag", "structural_tag", dict(value)
    if kind != "json_schema":
        _refuse_keys(f"response_format {kind}", value, ("type",))
        return None if kind == "text" else ("response_format json_object", "json_object", True)
    _refuse_keys("response_format json_schema", value, ("type", "json_schema"))
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError('response_format json_schema needs a json_schema object: {"name": ..., "schema": {...}}')
    _refuse_keys("response_format.json_schema", spec, _JSON_SCHEMA_KEYS)
    if not isinstance(spec.get("name"), str):
        raise ValueError("response_format.json_schema.name must be a string")
    if spec.get("strict") not in (None, True, False):
        raise ValueError(f"response_format.json_schema.strict must be true or false, got {shorten(spec['strict'])}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ValueError(f"response_format.json_schema.schema must be a JSON schema object, got {shorten(schema)}")
    return "response_format json_schema", "json", schema


def _backend_options(value: str | None, server_backend: str) -> dict[str, Any]:
    """Options from `guided_decoding_backend` ("name" or "name:opt,opt"); 400 for another backend."""
    if value is None:
        return {}
    if not isinstance(value, str):
        raise ValueError(f"guided_decoding_backend must be a string, got {shorten(value)}")
    name, _, opts = value.partition(":")
    if name not in ("auto", server_backend):
        raise ValueError(
            f"guided_decoding_backend {shorten(value)} is not supported: this server compiles every "
            f"constraint with {server_backend} (--structured-outputs-config); leave the field out"
        )
    options: dict[str, Any] = {}
    for opt in filter(None, (o.strip() for o in opts.split(","))):
        if opt not in _BACKEND_OPTIONS:
            raise ValueError(
                f"guided_decoding_backend option {shorten(opt)} is not supported; supported: "
                f"{', '.join(_BACKEND_OPTIONS)}"
            )
        if opt == "disable-any-whitespace":
            options["disable_any_whitespace"] = True
    return options


def structured_outputs_from_request(
    request: Any, tool_schema: dict | None = None, server_backend: str = "xgrammar"
) -> StructuredOutputsParams | None:
    """The one constraint a request sets, or None (ValueError, naming the fields, for a bad or doubled one)."""
    sources, options = _structured_outputs_sources(getattr(request, "structured_outputs", None))
    from_format = _response_format_source(getattr(request, "response_format", None))
    if from_format is not None:
        sources.append(from_format)
    for field, kind in GUIDED_FIELDS:
        value = getattr(request, field, None)
        if value is not None:
            sources.append((field, kind, value))
    if tool_schema is not None:
        sources.append(("tool_choice", "json", tool_schema))
    if len(sources) > 1:
        names = [s[0] for s in sources]
        raise ValueError(f"a request takes one output constraint; got {', '.join(names[:-1])} and {names[-1]}")
    if not sources:
        if getattr(request, "structured_outputs", None) is not None:
            raise ValueError(
                f"structured_outputs sets no constraint; give one of {', '.join(CONSTRAINT_KINDS)} "
                f"(or response_format / guided_*)"
            )
        return None
    field, kind, value = sources[0]
    backend_options = _backend_options(getattr(request, "guided_decoding_backend", None), server_backend)
    options = {**backend_options, **options}
    patterns = [
        ("guided_whitespace_pattern", getattr(request, "guided_whitespace_pattern", None)),
        (
            "structured_outputs.whitespace_pattern",
            (getattr(request, "structured_outputs", None) or {}).get("whitespace_pattern"),
        ),
    ]
    for name, pattern in patterns:
        if pattern is not None and kind in ("json", "json_object"):
            raise ValueError(
                f"{name} is not supported (xgrammar takes no whitespace pattern); send "
                f'structured_outputs: {{"disable_any_whitespace": true}} for compact JSON instead'
            )
    try:
        return StructuredOutputsParams(**{kind: value}, **options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field}: {e}") from None
