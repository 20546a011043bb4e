"""A pipeline's sink records (`pipelines.sinks`): its result again in the shape and
under the key its users read, and a copy of its dead letters, built once with the
outcome and sized to their topic like every record the worker writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from streams.contract.headers import RESULT_KEY_HEADER, SOURCE_OF_HEADER, TASK_ID_HEADER
from streams.pipelines.sinks import SinkSpec
from streams.pipelines.sources import pointer_get

if TYPE_CHECKING:
    from streams.contract.records import Task

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


def _key(spec: SinkSpec, task: Task, result_key: str) -> bytes:
    if spec.key == "result_key":
        return result_key.encode()
    kept = task.source_record
    if spec.key == "source_key" and kept is not None and kept.key is not None:
        key = kept.key
        if isinstance(key, str):
            return key.encode()
        return orjson.dumps(key, option=orjson.OPT_SORT_KEYS)
    return task.task_id.encode()


def _headers(spec: SinkSpec, task: Task, result: dict[str, Any]) -> tuple[tuple[str, bytes], ...]:
    headers = [(RESULT_KEY_HEADER, str(result["result_key"]).encode()),
               (TASK_ID_HEADER, task.task_id.encode())]  # fmt: skip
    kept = task.source_record
    if kept is not None:
        if kept.topic is not None:
            where = f"{kept.topic}/{kept.partition}/{kept.offset}"
            headers.append((SOURCE_OF_HEADER, where.encode()))
        for name in spec.headers:
            value = kept.headers.get(name)
            if value is not None:
                headers.append((name, value.encode()))
    return tuple(headers)


__all__ = ["SinkRecord", "dead_letter_record", "result_record"]
