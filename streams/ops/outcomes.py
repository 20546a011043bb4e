"""A pipeline's outcomes (results, dead letters) as the reports read them: the latest of
each task under each prompt version, one task partition at a time.

A task's results and dead letters all live in its task's partition (the task store
keeps them there, `store.taskstore`), so a report that compares versions task by task
holds one partition's outcomes at a time, not a year of them. A record tombstoned since
(erased, or past the store's retention) takes back what its key held, and only that: a
newer outcome of the task under another key stays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from streams.contract.records import json_object
from streams.kafka.scan import scan
from streams.settings import Settings

T = TypeVar("T")


async def latest_outcomes(
    settings: Settings,
    topic: str,
    partition: int,
    pipeline: str,
    shape: Callable[[dict[str, Any]], T | None],
) -> dict[tuple[str, str], T]:
    """Of one partition of `topic` (results or dead letters), the latest outcome of each
    of `pipeline`'s tasks per version, as `shape` keeps it (None: left out); one whose
    record was tombstoned since, left out."""
    latest: dict[tuple[str, str], tuple[bytes, T]] = {}
    keyed: dict[bytes, tuple[str, str]] = {}  # a latest outcome's key -> version, task
    async for records in scan(settings, topic, partitions=[partition]):
        for r in records:
            if r.key is None:
                continue
            if r.value is None:  # tombstoned: what its key held is gone
                gone = keyed.pop(r.key, None)
                if gone is not None:
                    latest.pop(gone, None)
                continue
            record = json_object(r.value)
            if record is None or record.get("pipeline") != pipeline:
                continue
            version, task_id = record.get("prompt_version"), record.get("task_id")
            if not isinstance(version, str) or not isinstance(task_id, str):
                continue  # a dead letter from before records named their version
            kept = shape(record)
            if kept is None:
                continue
            earlier = latest.get((version, task_id))
            if earlier is not None:
                keyed.pop(earlier[0], None)
            latest[(version, task_id)] = (r.key, kept)
            keyed[r.key] = (version, task_id)
    return {at: kept for at, (_, kept) in latest.items()}


__all__ = ["latest_outcomes"]
