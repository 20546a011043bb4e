"""A record's value as JSON holds it turned back into what an Avro schema takes: the
source record of an enriched Avro sink went through `llm-tasks` as JSON
(`schema_registry.jsonable`: bytes as base64, decimals as exact strings, dates and
times in ISO 8601), and fastavro writes bytes, `Decimal`s and datetimes.

Written here: fastavro reads and writes Python values and Avro's own JSON encoding,
not JSON made from decoded records; the walk is the inverse of `jsonable`, over a
schema expanded by `fastavro.parse_schema(expand=True)` (no named references left)."""

from __future__ import annotations

import base64
import datetime as dt
from decimal import Decimal
from typing import Any

_TIMES = {"timestamp-millis", "timestamp-micros", "local-timestamp-millis",
          "local-timestamp-micros"}  # fmt: skip
_PRIMITIVE_OF = {bool: ("boolean",), int: ("int", "long", "float", "double"),
                 float: ("float", "double")}  # fmt: skip


def avro_datum(value: Any, schema: Any) -> Any:
    """`value` (JSON types) as the Avro `schema` (expanded) writes it."""
    if isinstance(schema, list):
        return _union(value, schema)
    if isinstance(schema, str):
        return base64.b64decode(value) if schema == "bytes" and isinstance(value, str) else value
    kind, logical = schema.get("type"), schema.get("logicalType")
    if isinstance(kind, dict | list):
        return avro_datum(value, kind)
    if kind == "record" and isinstance(value, dict):
        return {f["name"]: avro_datum(value.get(f["name"], f.get("default")), f["type"])
                for f in schema["fields"]}  # fmt: skip
    if kind == "array" and isinstance(value, list):
        return [avro_datum(v, schema["items"]) for v in value]
    if kind == "map" and isinstance(value, dict):
        return {k: avro_datum(v, schema["values"]) for k, v in value.items()}
    return _scalar(value, kind, logical)


def _scalar(value: Any, kind: Any, logical: Any) -> Any:
    """A JSON string back to the bytes, decimal or time it was; anything else as it is."""
    if not isinstance(value, str):
        return value
    if logical == "decimal":
        return Decimal(value)
    if kind in ("bytes", "fixed"):
        return base64.b64decode(value)
    if logical in _TIMES:
        return dt.datetime.fromisoformat(value)
    if logical == "date":
        return dt.date.fromisoformat(value)
    if logical in ("time-millis", "time-micros"):
        return dt.time.fromisoformat(value)
    return value


def _union(value: Any, branches: list[Any]) -> Any:
    """The branch `value` is of (by its JSON type; the first that may hold it)."""
    if value is None:
        return None
    for branch in branches:
        if branch != "null" and _may_hold(branch, value):
            return avro_datum(value, branch)
    return value  # none may: fastavro says what is wrong


def _may_hold(branch: Any, value: Any) -> bool:
    kind = branch if isinstance(branch, str) else branch.get("type")
    if isinstance(kind, dict | list):
        return _may_hold(kind, value)
    if isinstance(value, dict):
        if kind == "record":
            return {f["name"] for f in branch["fields"] if "default" not in f} <= set(value)
        return kind == "map"
    if isinstance(value, list):
        return kind == "array"
    if isinstance(value, str):
        if kind == "enum":
            return value in branch["symbols"]
        return kind in ("string", "bytes", "fixed") or (
            isinstance(branch, dict) and branch.get("logicalType") is not None
        )
    return kind in _PRIMITIVE_OF.get(type(value), ())


__all__ = ["avro_datum"]
