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

from streams.kafka.clients import partitions_of
from streams.ops.outcomes import latest_outcomes
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
    versions = (from_version, to_version)

    def output(result: dict[str, Any]) -> dict[str, Any] | None:
        kept = result.get("output")
        return kept if result.get("prompt_version") in versions and isinstance(kept, dict) else None

    for partition in await partitions_of(settings, topic):
        latest = await latest_outcomes(settings, topic, partition, pipeline, output)
        before = {task: kept for (version, task), kept in latest.items() if version == from_version}
        after = {task: kept for (version, task), kept in latest.items() if version == to_version}
        both = sorted(set(before) & set(after))
        summarise(((before[t], after[t]) for t in both), schema, into=diffs)
        out.both += len(both)
        out.only_from += len(before) - len(both)
        out.only_to += len(after) - len(both)
    return out


__all__ = ["Comparison", "FieldDiff", "compare", "fields_of", "summarise"]
