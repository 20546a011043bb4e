"""Reading partitions to their real end: the one rule every reader of our topics uses.

The end a broker lists (ListOffsets) can be short of the real one: the demo
broker, Tansu, answers with the base offset + 1 of a partition's last batch
(KNOWLEDGE.md), so a reader that stops there misses the last records — a
replay that reads 19,969 of 20,000, a redrive that sees an old task state.
A fetch is right: its answer carries the partition's high watermark (and, for
read_committed readers, the last stable offset). So the end of a partition is
the listed end raised to what a fetch at that offset reports, and a scan reads
to that end. The task store's loader, replay, backtrack and the operator
commands all read through here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from streams.contract.records import json_object
from streams.kafka.clients import partitions_of, reader
from streams.settings import Settings

log = logging.getLogger(__name__)

END_FETCH_TIMEOUT_S = 30.0


def _fetched_end(consumer: AIOKafkaConsumer, tp: TopicPartition, committed: bool) -> int | None:
    """The end the last fetch of `tp` reported: the last stable offset for a
    read_committed reader (records past it are not readable yet), else the high watermark."""
    if committed:
        lso = consumer.last_stable_offset(tp)
        if lso is not None:
            return int(lso)
    high = consumer.highwater(tp)
    return int(high) if high is not None else None


async def end_offsets(
    consumer: AIOKafkaConsumer, tps: list[TopicPartition], *, read_committed: bool = True
) -> dict[TopicPartition, int]:
    """The real end of each partition: the listed end, raised to what a fetch at that
    offset reports. Re-assigns the consumer to `tps` (positions are left at the ends).
    `read_committed` must say how the consumer reads (its end is the last stable offset)."""
    if not tps:
        return {}
    consumer.assign(tps)  # fresh partition states: no watermark from an earlier fetch
    listed = await consumer.end_offsets(tps)
    for tp in tps:
        consumer.seek(tp, listed[tp])
    ends = dict(listed)
    waiting = set(tps)
    deadline = time.monotonic() + END_FETCH_TIMEOUT_S
    while waiting and time.monotonic() < deadline:
        await consumer.getmany(*waiting, timeout_ms=200)
        for tp in list(waiting):
            fetched = _fetched_end(consumer, tp, read_committed)
            if fetched is not None:
                ends[tp] = max(ends[tp], fetched)
                waiting.discard(tp)
    if waiting:
        log.warning("no fetch answer for %s in %.0fs; reading to their listed ends",
                    sorted(str(tp) for tp in waiting), END_FETCH_TIMEOUT_S)  # fmt: skip
    return ends


async def read_range(
    consumer: AIOKafkaConsumer,
    starts: dict[TopicPartition, int],
    stops: dict[TopicPartition, int],
    *,
    max_records: int | None = None,
) -> AsyncIterator[list[ConsumerRecord[bytes, bytes]]]:
    """Batches of records of each partition from `starts[tp]` to `stops[tp]` (exclusive),
    partitions interleaved. A gap (compaction, aborted transactions) ends nothing early:
    a partition is done once the consumer's position reaches its stop."""
    remaining = set()
    for tp, stop in stops.items():
        start = starts.get(tp, 0)
        if start < stop:
            consumer.seek(tp, start)
            remaining.add(tp)
    while remaining:
        batch = await consumer.getmany(*remaining, timeout_ms=1000, max_records=max_records)
        for tp, records in batch.items():
            within = [r for r in records if r.offset < stops[tp]]
            if within:
                yield within
        for tp in list(remaining):
            if await consumer.position(tp) >= stops[tp]:
                remaining.discard(tp)


async def scan(
    settings: Settings,
    topic: str,
    start: dict[int, int] | None = None,
    end: dict[int, int] | None = None,
    max_records: int | None = None,
) -> AsyncIterator[list[ConsumerRecord[bytes, bytes]]]:
    """Batches of committed records of `topic`, from `start` (default: the beginning)
    to `end` (default: the real end when the scan starts), partitions interleaved."""
    parts = await partitions_of(settings, topic)
    if not parts:
        return
    consumer = reader(settings, "scan")
    await consumer.start()
    try:
        tps = {p: TopicPartition(topic, p) for p in parts}
        ends = await end_offsets(consumer, list(tps.values()))
        stops = {tp: (end or {}).get(p, ends[tp]) for p, tp in tps.items()}
        starts = {tp: (start or {}).get(p, 0) for p, tp in tps.items()}
        async for records in read_range(consumer, starts, stops, max_records=max_records):
            yield records
    finally:
        await consumer.stop()


def latest_objects(records: Iterable[ConsumerRecord[bytes, bytes]]) -> dict[bytes, dict[str, Any]]:
    """The latest JSON object per key, as compaction keeps it: a tombstone deletes the key;
    a value that is not a JSON object is skipped (logged)."""
    latest: dict[bytes, dict[str, Any]] = {}
    for rec in records:
        if rec.key is None:
            continue
        if rec.value is None:
            latest.pop(rec.key, None)
            continue
        data = json_object(rec.value)
        if data is None:
            log.warning("skipping a value that is not a JSON object at %s/%d/%d",
                        rec.topic, rec.partition, rec.offset)  # fmt: skip
            continue
        latest[rec.key] = data
    return latest
