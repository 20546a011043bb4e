"""How outputs changed between two prompt versions, over the tasks answered under both.

Field by field, as the pipeline's output schema types them: labels (string
enums) as a flip matrix, numbers as the mean and mean absolute shift, lists
as the share changed and mean Jaccard similarity, anything else as the share
changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from streams.contract.records import json_object
from streams.kafka.clients import partitions_of
from streams.kafka.scan import scan
from streams.settings import Settings


@dataclass
class FieldDiff:
    name: str
    kind: str  # label | number | list | other
    compared: int = 0
    changed: int = 0
    flips: Counter[tuple[str, str]] = field(default_factory=Counter)
    shift_sum: float = 0.0
    abs_shift_sum: float = 0.0
    jaccard_sum: float = 0.0

    @property
    def changed_share(self) -> float:
        return self.changed / self.compared if self.compared else 0.0

    @property
    def mean_shift(self) -> float:
        return self.shift_sum / self.compared if self.compared else 0.0

    @property
    def mean_abs_shift(self) -> float:
        return self.abs_shift_sum / self.compared if self.compared else 0.0

    @property
    def mean_jaccard(self) -> float:
        return self.jaccard_sum / self.compared if self.compared else 1.0


def _kind(spec: dict[str, Any]) -> str:
    types = spec.get("type")
    types = types if isinstance(types, list) else [types]
    if "enum" in spec and "string" in types:
        return "label"
    if "number" in types or "integer" in types:
        return "number"
    if "array" in types:
        return "list"
    return "other"


def _canon(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def fields_of(schema: dict[str, Any]) -> dict[str, FieldDiff]:
    """One empty FieldDiff per top-level field of an output schema."""
    props: dict[str, Any] = schema.get("properties", {})
    return {name: FieldDiff(name, _kind(spec)) for name, spec in props.items()}


def summarise(
    pairs: Iterable[tuple[dict[str, Any], dict[str, Any]]],
    schema: dict[str, Any],
    into: dict[str, FieldDiff] | None = None,
) -> list[FieldDiff]:
    """One FieldDiff per top-level output field, over (before, after) output pairs (added
    to `into`'s, when given)."""
    diffs = fields_of(schema) if into is None else into
    for before, after in pairs:
        for name, d in diffs.items():
            if name not in before and name not in after:
                continue
            a, b = before.get(name), after.get(name)
            d.compared += 1
            if d.kind == "number" and isinstance(a, int | float) and isinstance(b, int | float):
                d.shift_sum += b - a
                d.abs_shift_sum += abs(b - a)
                d.changed += a != b
            elif d.kind == "list" and isinstance(a, list) and isinstance(b, list):
                sa, sb = {_canon(x) for x in a}, {_canon(x) for x in b}
                union = sa | sb
                d.jaccard_sum += len(sa & sb) / len(union) if union else 1.0
                d.changed += sa != sb
            else:
                same = _canon(a) == _canon(b)
                d.changed += not same
                if d.kind == "label" and not same:
                    d.flips[(str(a), str(b))] += 1
    return list(diffs.values())


@dataclass
class Comparison:
    """Two versions' outputs, field by field, over the tasks answered under both."""

    fields: list[FieldDiff]
    both: int = 0  # tasks answered under both
    only_from: int = 0  # under the first version alone
    only_to: int = 0  # under the second alone


async def compare(
    settings: Settings,
    pipeline: str,
    from_version: str,
    to_version: str,
    schema: dict[str, Any],
) -> Comparison:
    """The latest outputs of `pipeline`'s tasks under the two versions compared, read a
    partition of the results topic at a time: a task's results are all in its task's
    partition (`store.taskstore`: results live in their task's partition), so what is
    held is one partition's outputs of the two versions, not the topic's (a year of
    results was held whole). A result tombstoned since (erased, past the store's
    retention) is left out."""
    topic = settings.topics.results
    diffs = fields_of(schema)
    out = Comparison(list(diffs.values()))
    for partition in await partitions_of(settings, topic):
        before, after = await _latest_of(settings, partition, pipeline, from_version, to_version)
        both = sorted(set(before) & set(after))
        summarise(((before[t][1], after[t][1]) for t in both), schema, into=diffs)
        out.both += len(both)
        out.only_from += len(before) - len(both)
        out.only_to += len(after) - len(both)
    return out


Latest = dict[str, tuple[bytes, dict[str, Any]]]  # task id -> its result's key and output


async def _latest_of(
    settings: Settings, partition: int, pipeline: str, *versions: str
) -> list[Latest]:
    """Of one partition of the results topic, per version (in the order given), the
    latest output of each of `pipeline`'s tasks that is not tombstoned since."""
    latest: dict[str, Latest] = {version: {} for version in versions}
    keyed: dict[bytes, tuple[str, str]] = {}  # a latest output's key -> its version, task
    async for records in scan(settings, settings.topics.results, partitions=[partition]):
        for r in records:
            if r.key is None:
                continue
            if r.value is None:  # tombstoned: erased, or past the store's retention
                gone = keyed.pop(r.key, None)
                if gone is not None:
                    del latest[gone[0]][gone[1]]
                continue
            result = json_object(r.value)
            if result is None or result.get("pipeline") != pipeline:
                continue
            version, task_id = str(result.get("prompt_version")), result.get("task_id")
            by_task = latest.get(version)
            if by_task is None or not isinstance(result.get("output"), dict):
                continue
            if not isinstance(task_id, str):
                continue
            if (earlier := by_task.get(task_id)) is not None:
                keyed.pop(earlier[0], None)
            by_task[task_id] = (r.key, result["output"])
            keyed[r.key] = (version, task_id)
    return [latest[version] for version in versions]


__all__ = ["Comparison", "FieldDiff", "compare", "fields_of", "summarise"]
