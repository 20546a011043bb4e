"""How outputs changed between two prompt versions, over the tasks answered under both.

Field by field, as the pipeline's output schema types them: labels (string
enums) as a flip matrix, numbers as the mean and mean absolute shift, lists
as the share changed and mean Jaccard similarity, anything else as the share
changed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from streams.contract.records import json_object
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


Pairs = list[tuple[dict[str, Any], dict[str, Any]]]


def summarise(pairs: Pairs, schema: dict[str, Any]) -> list[FieldDiff]:
    """One FieldDiff per top-level output field, over (before, after) output pairs."""
    props: dict[str, Any] = schema.get("properties", {})
    diffs = {name: FieldDiff(name, _kind(spec)) for name, spec in props.items()}
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


async def version_pairs(
    settings: Settings, pipeline: str, from_version: str, to_version: str
) -> tuple[Pairs, int, int]:
    """(before, after) outputs of the tasks with a result under both versions (their
    latest each), and how many tasks had only the first or only the second."""
    latest: dict[str, dict[str, dict[str, Any]]] = {from_version: {}, to_version: {}}
    async for records in scan(settings, settings.topics.results):
        for r in records:
            result = json_object(r.value)
            if result is None or result.get("pipeline") != pipeline:
                continue
            by_task = latest.get(str(result.get("prompt_version")))
            if (
                by_task is not None
                and isinstance(result.get("output"), dict)
                and isinstance(result.get("task_id"), str)
            ):
                by_task[result["task_id"]] = result["output"]
    before, after = latest[from_version], latest[to_version]
    both = sorted(set(before) & set(after))
    return (
        [(before[t], after[t]) for t in both],
        len(set(before) - set(after)),
        len(set(after) - set(before)),
    )


__all__ = ["FieldDiff", "summarise", "version_pairs"]
