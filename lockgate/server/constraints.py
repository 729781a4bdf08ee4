"""Output constraints as HTTP clients write them, read into ``StructuredOutput``.

Owns: every request field that constrains what a model may generate, in the spellings lockgate
accepts: OpenAI's ``response_format``, vLLM's ``structured_outputs`` object and its older
``guided_*`` fields (with the whitespace options), SGLang's ``json_schema`` / ``regex`` / ``ebnf``,
and TGI's ``grammar``. ``read_constraints`` turns a request body's fields into the one
``structured`` value the sampling parameters carry and names the field it came from.

Invariants:

* At most one constraint per request; a second is a ``ValueError`` naming both.
* A constraint lockgate cannot honour is a ``ValueError`` (a 400 naming the field), never ignored;
  engine hints that do not change a valid output (vLLM's backend choice and the like) are ignored.
* Only parsing here: whether a grammar compiles is the grammar layer's business, at admission.
* JSON given as text is read with ``jsonsafe``'s limits (depth, Unicode, finite numbers).
* Imports only the stdlib, ``lockgate.jsonsafe`` and ``lockgate.sampling`` (no pydantic models, no torch).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from lockgate import jsonsafe
from lockgate.sampling import StructuredOutput


def schema_text(v: Any, where: str) -> str:
    """A JSON schema given as an object (or a boolean) or as JSON text -> JSON text."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict | bool):
        return json.dumps(v)
    raise ValueError(f"{where} must be a JSON schema (an object or JSON text), got {type(v).__name__}")


def _response_format(v: dict[str, Any]) -> StructuredOutput | None:
    """OpenAI's ``response_format``: text (no constraint), json_object, json_schema."""
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json", '{"type": "object"}')
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise ValueError("response_format.json_schema.schema is required")
        return StructuredOutput("json", schema_text(schema, "response_format.json_schema.schema"))
    raise ValueError(f"response_format.type must be one of text, json_object, json_schema, got {kind!r:.40}")


_VLLM_SO_OPTIONS = {"disable_fallback", "disable_additional_properties", "backend", "_backend",
                    "_backend_was_auto"}  # engine hints lockgate has no use for (they do not change a valid output)


def _json_whitespace(so: StructuredOutput, where: str, pattern: Any = None, none: bool = False) -> StructuredOutput:
    """A JSON constraint with vLLM's whitespace options: ``whitespace_pattern`` (a regex for the
    whitespace allowed between JSON tokens) or ``disable_any_whitespace`` (none at all), written into
    the schema's ``x-guidance`` options (llguidance's own place for them)."""
    if (pattern is None and not none) or (pattern is None and so.kind != "json"):
        return so  # (no whitespace to take away outside JSON: disable_any_whitespace changes nothing there)
    if so.kind != "json":
        raise ValueError(f"{where} applies to a JSON constraint only")
    if pattern is not None and not isinstance(pattern, str):
        raise ValueError(f"{where} must be a regex string")
    schema = jsonsafe.loads(so.value, "the JSON schema") if so.value.lstrip().startswith("{") else None
    if not isinstance(schema, dict):
        raise ValueError(f"{where} needs the JSON schema to be an object")
    given = schema.get("x-guidance") or {}
    if not isinstance(given, dict):
        raise ValueError(f"the JSON schema's x-guidance must be an object, got {type(given).__name__}")
    opts: dict[str, Any] = {"item_separator": ",", "key_separator": ":"}
    opts |= {"whitespace_flexible": True, "whitespace_pattern": pattern} if pattern is not None else \
        {"whitespace_flexible": False}
    schema["x-guidance"] = {**given, **opts}
    return StructuredOutput("json", json.dumps(schema))


def _structured_outputs(v: dict[str, Any]) -> StructuredOutput | None:
    """vLLM's ``structured_outputs`` object: exactly one of json, regex, choice, grammar, json_object,
    with ``whitespace_pattern`` or ``disable_any_whitespace`` for JSON."""
    pattern, none = v.get("whitespace_pattern"), bool(v.get("disable_any_whitespace"))
    given = {k: x for k, x in v.items() if x is not None and x is not False and k not in _VLLM_SO_OPTIONS
             and k not in ("whitespace_pattern", "disable_any_whitespace")}
    for k in given:
        if k not in ("json", "regex", "choice", "grammar", "json_object"):
            raise ValueError(f"structured_outputs.{k} is not supported by lockgate (supported: json, regex, "
                             "choice, grammar, json_object, whitespace_pattern, disable_any_whitespace)")
    if len(given) > 1:
        raise ValueError(f"structured_outputs takes one constraint, got {', '.join(sorted(given))}")
    if not given:
        return None
    (k, x), = given.items()
    return _json_whitespace(_constraint(k, x, f"structured_outputs.{k}"), "structured_outputs.whitespace_pattern",
                            pattern, none)


def _constraint(kind: str, v: Any, where: str) -> StructuredOutput:
    """One constraint by vLLM's names: json (schema), regex, choice (list of strings), grammar, json_object."""
    if kind == "json":
        return StructuredOutput("json", schema_text(v, where))
    if kind == "json_object":
        return StructuredOutput("json", '{"type": "object"}')
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise ValueError(f"{where} must be a non-empty list of non-empty strings")
        return StructuredOutput("choice", json.dumps(v))
    if not isinstance(v, str):
        raise ValueError(f"{where} must be a string, got {type(v).__name__}")
    return StructuredOutput("regex" if kind == "regex" else "lark", v)


# Request fields that constrain the output, and how each reads: OpenAI's response_format, vLLM's
# structured_outputs and its older guided_* fields, SGLang's json_schema / regex / ebnf.
_CONSTRAINTS: dict[str, Callable[[Any], StructuredOutput | None]] = {
    "response_format": lambda v: _response_format(v) if isinstance(v, dict) else _bad("response_format", v),
    "structured_outputs": lambda v: _structured_outputs(v) if isinstance(v, dict) else _bad("structured_outputs", v),
    "guided_json": lambda v: _constraint("json", v, "guided_json"),
    "guided_regex": lambda v: _constraint("regex", v, "guided_regex"),
    "guided_choice": lambda v: _constraint("choice", v, "guided_choice"),
    "guided_grammar": lambda v: _constraint("grammar", v, "guided_grammar"),
    "json_schema": lambda v: _constraint("json", v, "json_schema"),
    "regex": lambda v: _constraint("regex", v, "regex"),
    "ebnf": lambda v: _constraint("grammar", v, "ebnf"),
}


def _bad(name: str, v: Any) -> StructuredOutput:
    raise ValueError(f"{name} must be an object, got {type(v).__name__}")


# the body fields read_constraints consumes
CONSTRAINT_FIELDS = frozenset({*_CONSTRAINTS, "guided_whitespace_pattern"})


def read_constraints(data: dict[str, Any]) -> dict[str, Any]:
    """A request body (OpenAI endpoints) with its constraint fields read: the copy has none of
    ``CONSTRAINT_FIELDS`` left and, where one was given, ``structured`` (the constraint) and
    ``structured_field`` (which field gave it). A client cannot set those two itself."""
    found: dict[str, StructuredOutput] = {}
    for name, read in _CONSTRAINTS.items():
        if data.get(name) is not None:
            try:
                so = read(data[name])
            except ValueError as e:  # every message opens with the field (the 400's param)
                raise ValueError(str(e) if str(e).startswith(name) else f"{name}: {e}") from None
            if so is not None:
                found[name] = so
    if len(found) > 1:
        raise ValueError(f"only one output constraint per request, got {', '.join(found)}")
    pattern = data.get("guided_whitespace_pattern")  # vLLM's older field, beside guided_json
    data = {k: v for k, v in data.items() if k not in CONSTRAINT_FIELDS and k not in ("structured", "structured_field")}
    if found:
        (name, so), = found.items()
        try:
            data["structured"] = _json_whitespace(so, "guided_whitespace_pattern", pattern)
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith("guided_") else f"{name}: {e}") from None
        data["structured_field"] = name
    elif pattern is not None:
        raise ValueError("guided_whitespace_pattern applies to a JSON constraint only")
    return data


def tgi_grammar(g: Any) -> StructuredOutput:
    """TGI's ``grammar``: ``{"type": "json" | "json_schema" | "regex", "value": ...}``."""
    if not isinstance(g, dict) or "type" not in g or "value" not in g:
        raise ValueError('grammar must be {"type": "json" | "regex", "value": ...}')
    kind, value = g["type"], g["value"]
    if kind == "json":
        return StructuredOutput("json", schema_text(value, "grammar.value"))
    if kind == "json_schema":
        schema = value.get("schema") if isinstance(value, dict) else None
        return StructuredOutput("json", schema_text(schema, "grammar.value.schema"))
    if kind == "regex":
        if not isinstance(value, str):
            raise ValueError("grammar.value must be a regex string for type regex")
        return StructuredOutput("regex", value)
    raise ValueError(f"grammar.type must be json, json_schema or regex, got {kind!r:.40}")
