"""Defaults of optional output fields, taken from the output schema's `default`s."""

from __future__ import annotations

from typing import Any

import orjson


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    """Follow a local `$ref` (`#/$defs/x`), once per level."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return target
    return schema


def has_defaults(schema: Any) -> bool:
    """Whether any property of the schema declares a `default`."""
    if isinstance(schema, dict):
        props = schema.get("properties")
        if isinstance(props, dict) and any(
            isinstance(sub, dict) and "default" in sub for sub in props.values()
        ):
            return True
        return any(has_defaults(v) for v in schema.values())
    if isinstance(schema, list):
        return any(has_defaults(v) for v in schema)
    return False


def fill_defaults(data: Any, schema: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """`data` with the schema's `default` set for every absent optional property, in
    nested objects and array items too. Values present are never changed."""
    schema = _resolve(schema, root)
    if depth > 32 or not isinstance(schema, dict):
        return data
    if isinstance(data, dict):
        props = schema.get("properties")
        if isinstance(props, dict):
            for name, sub in props.items():
                sub = _resolve(sub, root)
                if name not in data and isinstance(sub, dict) and "default" in sub:
                    data[name] = orjson.loads(orjson.dumps(sub["default"]))  # a fresh copy
                if name in data:
                    data[name] = fill_defaults(data[name], sub, root, depth + 1)
    elif isinstance(data, list) and isinstance(schema.get("items"), dict):
        return [fill_defaults(item, schema["items"], root, depth + 1) for item in data]
    return data
