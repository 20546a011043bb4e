"""A pipeline's sink records (`pipelines.sinks`): its result again in the shape and
under the key its users read, and a copy of its dead letters, built once with the
outcome and sized to their topic like every record the worker writes."""

from __future__ import annotations

import base64
import io
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fastavro
import orjson

from streams.contract.headers import RESULT_KEY_HEADER, SOURCE_OF_HEADER, TASK_ID_HEADER
from streams.core.avro_schema import avro_schema
from streams.core.avro_values import avro_datum
from streams.errors import ConfigError
from streams.pipelines.sinks import SinkSpec
from streams.pipelines.sources import array_index, pointer_get

if TYPE_CHECKING:
    from streams.contract.records import Task

DRAFT = "https://json-schema.org/draft/2020-12/schema"
# The provenance an enriched record carries beside the answer, from the result record.
PROVENANCE = ("task_id", "result_key", "pipeline", "prompt_version", "model", "cost_usd",
              "cached", "processed_at")  # fmt: skip


@dataclass(frozen=True)
class SinkRecord:
    """One record for a sink topic; its partition is the writer's to choose (the
    topic's own partition count, by key, as Kafka's default partitioner would)."""

    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


def result_record(spec: SinkSpec, task: Task, result: dict[str, Any]) -> SinkRecord:
    """The sink record of a result (`result`: the record as in the results topic)."""
    shape = spec.shape
    if shape == "envelope":
        value: Any = result
    elif shape == "output":
        value = result["output"]
    else:
        value = _enriched(spec, task, result)
    return SinkRecord(spec.topic, _key(spec, task, str(result["result_key"])),
                      orjson.dumps(value), _headers(spec, task, result))  # fmt: skip


def value_schema(spec: SinkSpec, output_schema: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of the sink's values, from the pipeline's output schema: the answer
    alone, the result record, or an enriched record (the source record's own fields are
    whatever they are; the answer, its provenance and `fields` are said)."""
    from streams.contract.records import contract_schemas

    if spec.shape == "output":
        return {**output_schema, "$schema": DRAFT}
    if spec.shape == "envelope":
        result = contract_schemas()["result.schema.json"]
        return {**result, "$schema": DRAFT,
                "properties": {**result["properties"], "output": _bare(output_schema)}}  # fmt: skip
    provenance: dict[str, Any] = {
        "task_id": {"type": "string"}, "result_key": {"type": "string"},
        "pipeline": {"type": "string"}, "prompt_version": {"type": "string"},
        "model": {"type": "string"}, "cost_usd": {"type": "number", "minimum": 0},
        "cached": {"type": "boolean"}, "processed_at": {"type": "string"},
    }  # fmt: skip
    if not spec.fields:
        provenance["output"] = _bare(output_schema)
    answer = {"type": "object", "properties": provenance, "required": sorted(provenance)}
    schema: dict[str, Any] = {
        "$schema": DRAFT,
        "title": f"{spec.topic} value",
        "type": "object",
        "properties": {spec.field: answer},
        "required": [spec.field],
        "additionalProperties": True,  # the source record's fields, as they come
    }
    for name in spec.fields:  # what a pointer finds, or null when the answer has none
        schema["properties"][name] = {}
    return schema


def _bare(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema to nest in another: without its own `$schema` and `$id`; one that refers to
    its own definitions cannot be nested as it is (its `$ref`s are its root's)."""
    if "$defs" in schema or "definitions" in schema:
        raise ConfigError(
            "a sink with format json_schema needs an output schema without $defs (its "
            "references would not resolve nested in the record's)"
        )
    return {k: v for k, v in schema.items() if k not in ("$schema", "$id")}


def registered_schema(
    spec: SinkSpec, output_schema: dict[str, Any], source_schema: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """The schema a sink registers (its type, as the registry names it, and the schema):
    JSON Schema, or Avro derived from it (`core.avro_schema`) — for an enriched record,
    the source's own Avro record schema (`source_schema`, its subject's latest) with the
    answer's fields added."""
    schema = value_schema(spec, output_schema)
    namespace = "llm_streams." + re.sub(r"[^A-Za-z0-9_]", "_", spec.topic)
    if spec.format == "avro" and spec.shape == "enriched":
        return "AVRO", _enriched_avro(spec, output_schema, source_schema, namespace)
    if spec.format == "avro":
        return "AVRO", avro_schema(schema, "Value", namespace)
    return "JSON", schema


def _enriched_avro(
    spec: SinkSpec,
    output_schema: dict[str, Any],
    source: dict[str, Any] | None,
    namespace: str,
) -> dict[str, Any]:
    """The source's record schema with the provenance field and the `fields` set from the
    answer (each a union with null: the answer may have none there)."""
    if source is None:  # offline (`pipelines validate`): known at start
        raise ConfigError("an enriched Avro sink takes its source topic's Avro schema from the "
                          "registry at start")  # fmt: skip
    if source.get("type") != "record" or not isinstance(source.get("fields"), list):
        raise ConfigError("an enriched Avro sink needs its source's values to be Avro records; "
                          f"the source's schema is {str(source)[:120]}")  # fmt: skip
    json_schema = value_schema(spec, output_schema)
    answer = {"type": "object", "required": [spec.field],
              "properties": {spec.field: json_schema["properties"][spec.field]}}  # fmt: skip
    added = avro_schema(answer, "Llm", namespace)["fields"]
    for name, pointer in spec.fields.items():
        at = _schema_at(output_schema, pointer, name)
        avro = avro_schema({"type": "object", "required": ["v"], "properties": {"v": at}},
                           f"Field_{name}", namespace)["fields"][0]["type"]  # fmt: skip
        members = avro if isinstance(avro, list) else [avro]
        added.append({"name": name, "type": ["null", *[m for m in members if m != "null"]],
                      "default": None})  # fmt: skip
    taken = {f.get("name") for f in source["fields"]} & {f["name"] for f in added}
    if taken:
        raise ConfigError(f"an enriched Avro sink adds {sorted(taken)}, which the source's "
                          "record has: name sink.field / sink.fields otherwise")  # fmt: skip
    return {**source, "fields": [*source["fields"], *added]}


def _schema_at(schema: dict[str, Any], pointer: str, name: str) -> dict[str, Any]:
    """The answer's schema where `pointer` points (through properties and items)."""
    node: Any = schema
    for part in pointer.lstrip("/").split("/"):
        if isinstance(node, dict) and part in (node.get("properties") or {}):
            node = node["properties"][part]
        elif (
            isinstance(node, dict)
            and array_index(part) < sys.maxsize
            and isinstance(node.get("items"), dict)
        ):
            node = node["items"]
        else:
            raise ConfigError(f"sink.fields.{name}: the answer's schema has nothing at {pointer}")
    return node if isinstance(node, dict) else {}


def framing(kind: str, schema: dict[str, Any], schema_id: int) -> Callable[[bytes], bytes]:
    """How a sink record's JSON value goes on the wire under `schema_id`: the registry's
    framing (0, the id, the body), the body JSON or Avro."""
    head = b"\x00" + schema_id.to_bytes(4, "big")
    if kind != "AVRO":
        return lambda value: head + value
    parsed = fastavro.parse_schema(schema)
    expanded = fastavro.parse_schema(schema, expand=True)

    def avro(value: bytes) -> bytes:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, avro_datum(orjson.loads(value), expanded))
        return head + out.getvalue()

    return avro


def dead_letter_record(spec: SinkSpec, key: str, letter: bytes) -> SinkRecord | None:
    """The copy of a dead letter (`key`: its key in the dead-letter topic, its task id)
    for the pipeline's own dead-letter topic, if it has one."""
    if spec.dead_letters is None:
        return None
    return SinkRecord(spec.dead_letters, key.encode(), letter, ((TASK_ID_HEADER, key.encode()),))


def _enriched(spec: SinkSpec, task: Task, result: dict[str, Any]) -> dict[str, Any]:
    """The source record's value (a task of no source: its input) with the answer."""
    kept = task.source_record
    base = kept.value if kept is not None else task.input
    record = dict(base) if isinstance(base, dict) else {"value": base}
    provenance = {name: result.get(name) for name in PROVENANCE}
    output = result["output"]
    if spec.fields:
        for name, pointer in spec.fields.items():
            try:
                record[name] = pointer_get(output, pointer)
            except KeyError:
                record[name] = None  # the answer has no such field: null, said so
        record[spec.field] = provenance
    else:
        record[spec.field] = {"output": output, **provenance}
    return record


def erased(
    spec: SinkSpec,
    task_id: str,
    source_key: Any,
    result_keys: list[str],
    source_key_base64: str | None = None,
) -> list[tuple[str, bytes]]:
    """Where a task's sink records are (topic, key), to erase them: under each of its
    result keys, or its one key; and its dead letter's copy."""
    if spec.key == "result_key":
        found = [(spec.topic, key.encode()) for key in result_keys]
    elif spec.key == "source_key" and source_key is not None:
        found = [(spec.topic, _key_bytes(source_key, source_key_base64))]
    else:
        found = [(spec.topic, task_id.encode())]
    if spec.dead_letters is not None:
        found.append((spec.dead_letters, task_id.encode()))
    return found


def _key(spec: SinkSpec, task: Task, result_key: str) -> bytes:
    if spec.key == "result_key":
        return result_key.encode()
    kept = task.source_record
    if spec.key == "source_key" and kept is not None and kept.key is not None:
        return _key_bytes(kept.key, kept.key_base64)
    return task.task_id.encode()


def _key_bytes(key: Any, raw_base64: str | None = None) -> bytes:
    """A source record's key as a sink record's: its bytes as read when they are not
    UTF-8 (`raw_base64`), its text, or a structure's canonical JSON."""
    if raw_base64 is not None:
        return base64.b64decode(raw_base64)
    if isinstance(key, str):
        return key.encode()
    return orjson.dumps(key, option=orjson.OPT_SORT_KEYS)


def _headers(spec: SinkSpec, task: Task, result: dict[str, Any]) -> tuple[tuple[str, bytes], ...]:
    headers = [(RESULT_KEY_HEADER, str(result["result_key"]).encode()),
               (TASK_ID_HEADER, task.task_id.encode())]  # fmt: skip
    kept = task.source_record
    if kept is not None:
        if kept.topic is not None:
            where = f"{kept.topic}/{kept.partition}/{kept.offset}"
            headers.append((SOURCE_OF_HEADER, where.encode()))
        raw = kept.headers_base64 or {}
        for name in spec.headers:
            value = kept.headers.get(name)
            if name in raw:  # bytes that are not UTF-8: as read
                headers.append((name, base64.b64decode(raw[name])))
            elif value is not None:
                headers.append((name, value.encode()))
    return tuple(headers)


__all__ = [
    "SinkRecord",
    "dead_letter_record",
    "erased",
    "framing",
    "registered_schema",
    "result_record",
    "value_schema",
]
