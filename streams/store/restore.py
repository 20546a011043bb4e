"""A partition's maps read again from their topics (`load_partition`): from the local
copy's checkpoint to the topics' real end, the latest value per key, durable as it
goes so that a load cut short goes on from where it was; a partition's maps kept
following its topics (`follow_partition`: a standby's warm copy, so that taking the
partition over reads only the last records); and what this version can read of a
stored value (`readable`: a newer version's extra fields are fine, a value without
what the worker reads is skipped and counted, never taken for an answer)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from aiokafka import TopicPartition
from pydantic import ValidationError

from streams.core.taskstate import TaskState
from streams.kafka.clients import reader
from streams.kafka.scan import end_offsets, read_range
from streams.settings import Settings
from streams.store.maps import Kind, Maps, now_ms

# A load makes its progress durable this often, and takes this many records a fetch:
# what it holds in memory between two flushes. Measured (1,000,000 results and task
# states, one partition, a fresh RocksDB): 20,000 and all fetched records at once
# peaked at 202-208 MB; 5,000 and 1,000 at 150 MB, in the same 42-44 s.
LOAD_FLUSH_RECORDS = 5_000
LOAD_FETCH_RECORDS = 1_000


def readable(kind: Kind, value: bytes) -> bool:
    """Can this version use a stored value of map `kind`? Unknown fields are fine (a newer
    version wrote them); a value without what the worker reads from it is not."""
    try:
        if kind is Kind.TASK_STATES:
            TaskState.loads(value)
            return True
        data = orjson.loads(value)
    except (orjson.JSONDecodeError, ValidationError, TypeError, ValueError):
        return False
    if not isinstance(data, dict):
        return False
    if kind is Kind.RESULTS:
        return (
            isinstance(data.get("output"), dict)
            and isinstance(data.get("model"), str)
            and isinstance(data.get("attempts", 0), int)
        )
    if kind is Kind.DEAD_LETTERS:
        error = data.get("error")
        return isinstance(error, dict) and isinstance(data.get("attempts", 0), int)
    return True


async def load_partition(
    settings: Settings,
    topics: dict[Kind, str],
    partition: int,
    maps: Maps,
    on_unreadable: Callable[[Kind, Any], None] | None = None,
) -> dict[Kind, int] | None:
    """Read partition `partition` of each topic from the maps' checkpoint to its real end
    into `maps` (latest value per key; a null value deletes; a value this version cannot
    read is skipped and reported to `on_unreadable`), durable every LOAD_FLUSH_RECORDS
    records (a load cut short goes on from there). Returns records read per kind, or
    None when the maps are ahead of a topic (it was deleted and made again): they are
    not that topic's any more."""
    consumer = reader(
        settings, "state", client_id=f"{settings.app_id}-state-{partition}",
        max_partition_fetch_bytes=4 * 1024 * 1024,
    )  # fmt: skip
    try:
        await consumer.start()  # in the try: one that fails or is cancelled is stopped too
        kind_of = {TopicPartition(topic, partition): kind for kind, topic in topics.items()}
        ends = await end_offsets(consumer, list(kind_of))
        progress = maps.checkpoint()
        if any(progress[kind] > ends[tp] for tp, kind in kind_of.items()):
            return None
        counts = dict.fromkeys(topics, 0)
        starts = {tp: progress[kind] for tp, kind in kind_of.items()}
        skipped = False
        unflushed = 0
        async for records in read_range(consumer, starts, ends, max_records=LOAD_FETCH_RECORDS):
            kind = kind_of[TopicPartition(records[0].topic, records[0].partition)]
            counts[kind] += len(records)
            skipped |= _stage(kind, records, maps, on_unreadable)
            progress[kind] = records[-1].offset + 1
            unflushed += len(records)
            if unflushed >= LOAD_FLUSH_RECORDS:
                maps.flush(progress, skipped=skipped)
                unflushed = 0
        maps.flush({kind: ends[tp] for tp, kind in kind_of.items()}, skipped=skipped)
        return counts
    finally:
        await consumer.stop()


def _stage(
    kind: Kind,
    records: Sequence[Any],
    maps: Maps,
    on_unreadable: Callable[[Kind, Any], None] | None,
) -> bool:
    """Stage `records` of map `kind` (a null value deletes its key); True when one was
    skipped as unreadable (reported to `on_unreadable`)."""
    skipped = False
    for record in records:
        if record.key is None:
            continue
        at = record.timestamp if record.timestamp and record.timestamp > 0 else now_ms()
        if record.value is None or readable(kind, record.value):
            maps.stage(kind, record.key, record.value, at)
        else:
            skipped = True
            if on_unreadable is not None:
                on_unreadable(kind, record)
    return skipped


async def follow_partition(
    settings: Settings,
    topics: dict[Kind, str],
    partition: int,
    maps: Maps,
    on_unreadable: Callable[[Kind, Any], None] | None = None,
    on_flush: Callable[[int], None] | None = None,
) -> None:
    """Keep `maps` following partition `partition` of each topic, from their checkpoint
    on, until cancelled: what they read is durable every LOAD_FLUSH_RECORDS records and
    at least every commit interval (then `on_flush(records)`), so that whoever opens the
    maps next reads only what came after. Returns when the maps are ahead of a topic
    (made again): they are not that topic's any more. Cancelled, it leaves the maps as
    they were at their last flush (what was staged since is the caller's to discard)."""
    consumer = reader(
        settings, "state", client_id=f"{settings.app_id}-standby-{partition}",
        max_partition_fetch_bytes=4 * 1024 * 1024, fetch_max_wait_ms=500,
    )  # fmt: skip
    try:
        await consumer.start()  # in the try: one that fails or is cancelled is stopped too
        kind_of = {TopicPartition(topic, partition): kind for kind, topic in topics.items()}
        progress = maps.checkpoint()
        ends = await end_offsets(consumer, list(kind_of))
        if any(progress[kind] > ends[tp] for tp, kind in kind_of.items()):
            return
        for tp, kind in kind_of.items():
            consumer.seek(tp, progress[kind])
        every_s = settings.kafka.commit_interval_s
        skipped, unflushed, flushed_at = False, 0, time.monotonic()
        while True:
            batch = await consumer.getmany(timeout_ms=1000, max_records=LOAD_FETCH_RECORDS)
            for tp, records in batch.items():
                skipped |= _stage(kind_of[tp], records, maps, on_unreadable)
                unflushed += len(records)
            due = time.monotonic() - flushed_at >= every_s
            if unflushed >= LOAD_FLUSH_RECORDS or (unflushed and due):
                # The positions pass transaction markers and compacted gaps too.
                for tp, kind in kind_of.items():
                    progress[kind] = await consumer.position(tp)
                maps.flush(progress, skipped=skipped)
                if on_flush is not None:
                    on_flush(unflushed)
                skipped, unflushed, flushed_at = False, 0, time.monotonic()
            elif due:
                if on_flush is not None:
                    on_flush(0)
                flushed_at = time.monotonic()
    finally:
        await consumer.stop()


__all__ = ["LOAD_FLUSH_RECORDS", "follow_partition", "load_partition", "readable"]
