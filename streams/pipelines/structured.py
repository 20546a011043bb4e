"""How a request asks for an answer of the output schema, per structured-output mode, and
what OpenAI's strict mode takes of a schema (`strict_view`; what it leaves out, what it
cannot take)."""

from __future__ import annotations

import json
from typing import Any

from streams.llm.client import SCHEMA_IN_PROMPT


def structured_output(
    mode: str, name: str, schema: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """How a request asks for an answer of `schema`: (response_format, tool, text for the
    end of the system message) for a version's `response_format` mode."""
    name = name.replace("-", "_")
    if mode == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": strict_view(schema),
                                                      "strict": True}}  # fmt: skip
        return fmt, None, ""
    if mode == "tool_call":
        tool = {"name": name, "description": "Give the answer.",
                "parameters": strict_view(schema), "strict": True}  # fmt: skip
        return {}, tool, ""
    if mode == "schema_in_prompt":
        text = f"\n\n{SCHEMA_IN_PROMPT}\n{json.dumps(schema, sort_keys=True)}"
        return {"type": "json_object"}, None, text
    return {"type": "json_object"}, None, ""


# What OpenAI's strict structured outputs take of JSON Schema (its documented subset).
STRICT_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum", "const",
    "anyOf", "$ref", "$defs", "definitions", "description", "title", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems",
    "maxItems", "$schema", "$id",
})  # fmt: skip


# Keywords whose values are maps of names to schemas, lists of schemas, or a schema.
_NAMED, _LISTED, _NESTED = ("properties", "$defs", "definitions"), ("anyOf",), ("items",)


def strict_view(schema: Any) -> Any:
    """The output schema as a strict-mode request carries it: the keywords outside OpenAI's
    strict subset (`minLength`, `uniqueItems`, ...) left out — a strict endpoint refuses
    them — while the answer is still checked against the whole schema here."""
    if not isinstance(schema, dict):
        return schema
    view: dict[str, Any] = {}
    for key, value in schema.items():
        if key not in STRICT_KEYWORDS:
            continue
        if key in _NAMED and isinstance(value, dict):
            view[key] = {name: strict_view(sub) for name, sub in value.items()}
        elif key in _LISTED and isinstance(value, list):
            view[key] = [strict_view(sub) for sub in value]
        elif key in _NESTED:
            view[key] = strict_view(value)
        else:
            view[key] = value
    return view


def strict_dropped(schema: Any, at: str = "#") -> list[str]:
    """Where the strict view leaves narrowing keywords out (checked here, not sent)."""
    if not isinstance(schema, dict):
        return []
    found = [f"{at}: `{k}`" for k in sorted(set(schema) & NARROWING)]
    for key in _NAMED:
        for name, sub in (schema.get(key) or {}).items():
            found += strict_dropped(sub, f"{at}/{key}/{name}")
    for i, sub in enumerate(schema.get("anyOf") or []):
        found += strict_dropped(sub, f"{at}/anyOf/{i}")
    if isinstance(schema.get("items"), dict):
        found += strict_dropped(schema["items"], f"{at}/items")
    return found


# Keywords outside the strict subset that only narrow what the subset allows: left out of
# the request, they cost the model a hint, not the answer's shape (checked here anyway).
NARROWING = frozenset({
    "minLength", "maxLength", "uniqueItems", "minProperties", "maxProperties", "default",
    "examples", "$comment", "readOnly", "writeOnly", "deprecated", "contentEncoding",
    "contentMediaType",
})  # fmt: skip


def strict_subset_issues(schema: Any, at: str = "#") -> list[str]:
    """Where an output schema cannot be asked for as it is in OpenAI's strict mode:
    keywords outside the subset that shape the answer (`oneOf`, `allOf`, `not`, ...:
    left out of the request, the model is not told them), objects without
    `additionalProperties: false` or with optional properties. Narrowing keywords
    (`maxLength`, `uniqueItems`, ...) are no issue: `strict_dropped` names them."""
    if not isinstance(schema, dict):
        return []
    found = [f"{at}: `{k}` is outside the strict-mode subset"
             for k in sorted(set(schema) - STRICT_KEYWORDS - NARROWING)]  # fmt: skip
    props = schema.get("properties")
    if schema.get("type") == "object" or isinstance(props, dict):
        if schema.get("additionalProperties") is not False:
            found.append(f"{at}: strict mode needs additionalProperties: false")
        optional = sorted(set(props or {}) - set(schema.get("required") or []))
        if optional:
            found.append(f"{at}: strict mode needs every property required ({optional})")
    for key in ("properties", "$defs", "definitions"):
        for name, sub in (schema.get(key) or {}).items():
            found += strict_subset_issues(sub, f"{at}/{key}/{name}")
    for i, sub in enumerate(schema.get("anyOf") or []):
        found += strict_subset_issues(sub, f"{at}/anyOf/{i}")
    if isinstance(schema.get("items"), dict):
        found += strict_subset_issues(schema["items"], f"{at}/items")
    return found
