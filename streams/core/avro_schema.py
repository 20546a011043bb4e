"""A pipeline's answer as Avro: its JSON Schema (the output schema, or the result record
with it) turned into an Avro schema for a sink with `format: avro`.

Written here because no maintained library turns JSON Schema into Avro (the Avro
tools go the other way, or from Python classes). The subset is what output schemas
use, and anything else is refused at start with the path it is at, never guessed:
objects with declared properties become records (a property not required: a union
with null, default null), string enums enums (when the symbols are Avro names, else
strings), strings, integers (long), numbers (double), booleans, arrays, `$ref` into
the schema's own `$defs`, and `anyOf`/`type` lists of those as unions."""

from __future__ import annotations

import re
from typing import Any

from streams.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PRIMITIVES = {"string": "string", "integer": "long", "number": "double",
               "boolean": "boolean", "null": "null"}  # fmt: skip


def avro_schema(schema: dict[str, Any], name: str, namespace: str) -> dict[str, Any]:
    """The Avro record schema of JSON Schema `schema` (an object), named `name`."""
    converted = _Converter(schema, namespace).convert(schema, name, "")
    if not isinstance(converted, dict) or converted.get("type") != "record":
        raise ConfigError(f"format avro: {name} must be an object with properties")
    return converted


class _Converter:
    def __init__(self, root: dict[str, Any], namespace: str) -> None:
        self.root = root
        self.namespace = namespace
        self.named: set[str] = set()

    def convert(self, node: dict[str, Any], name: str, path: str) -> Any:
        if "$ref" in node:
            return self.convert(self._resolve(node["$ref"], path), name, path)
        options = node.get("anyOf") or node.get("oneOf")
        kinds = node.get("type")
        if isinstance(kinds, list):
            return self._union([{**node, "type": k} for k in kinds], name, path)
        if isinstance(options, list):
            return self._union(options, name, path)
        if kinds == "object":
            return self._record(node, name, path)
        if kinds == "array":
            items = node.get("items")
            if not isinstance(items, dict):
                raise self._refused(path, "an array without one `items` schema")
            return {"type": "array", "items": self.convert(items, f"{name}_item", f"{path}[]")}
        if kinds == "string" and isinstance(node.get("enum"), list):
            symbols = node["enum"]
            if all(isinstance(s, str) and _NAME.match(s) for s in symbols):
                return {"type": "enum", "name": self._unique(name), "symbols": list(symbols)}
            return "string"
        if isinstance(kinds, str) and kinds in _PRIMITIVES:
            return _PRIMITIVES[kinds]
        raise self._refused(path, "no single type (Avro needs one)")

    def _union(self, branches: list[dict[str, Any]], name: str, path: str) -> list[Any]:
        union: list[Any] = []
        for i, branch in enumerate(branches):
            avro = self.convert(branch, f"{name}_{i}", path)
            for member in avro if isinstance(avro, list) else [avro]:
                if member not in union:
                    union.append(member)
        return sorted(union, key=lambda m: m != "null")  # null first: default null

    def _record(self, node: dict[str, Any], name: str, path: str) -> dict[str, Any]:
        """An object: a record of its properties, or a map when it declares none but
        what every value is (`additionalProperties`)."""
        properties = node.get("properties")
        values = node.get("additionalProperties")
        if not properties and isinstance(values, dict):  # names free, values alike: a map
            return {"type": "map", "values": self.convert(values, f"{name}_value", f"{path}.*")}
        if not isinstance(properties, dict) or not properties:
            raise self._refused(path, "an object without declared properties")
        required = set(node.get("required") or [])
        fields = []
        for field, sub in properties.items():
            if not _NAME.match(field):
                raise self._refused(f"{path}.{field}", "a name Avro does not allow")
            avro = self.convert(sub, f"{name}_{field}", f"{path}.{field}")
            if field in required:
                fields.append({"name": field, "type": avro})
            else:
                members = avro if isinstance(avro, list) else [avro]
                union = ["null", *[m for m in members if m != "null"]]
                fields.append({"name": field, "type": union, "default": None})
        return {"type": "record", "name": self._unique(name), "namespace": self.namespace,
                "fields": fields}  # fmt: skip

    def _resolve(self, ref: str, path: str) -> dict[str, Any]:
        if not ref.startswith("#/"):
            raise self._refused(path, f"a reference outside the schema ({ref})")
        node: Any = self.root
        for part in ref[2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            raise self._refused(path, f"a reference to nothing ({ref})")
        return node

    def _unique(self, name: str) -> str:
        name = re.sub(r"[^A-Za-z0-9_]", "_", name)
        found, n = name, 1
        while found in self.named:
            n += 1
            found = f"{name}{n}"
        self.named.add(found)
        return found

    @staticmethod
    def _refused(path: str, why: str) -> ConfigError:
        return ConfigError(f"format avro: the answer's schema at {path or '(root)'} has {why}")


__all__ = ["avro_schema"]
