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

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import ConsumerRecord

from streams.contract.records import json_object
from streams.kafka.clients import admin, partitions_of, reader
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
    partitions: Collection[int] | None = None,
) -> AsyncIterator[list[ConsumerRecord[bytes, bytes]]]:
    """Batches of committed records of `topic` (of its `partitions`, when given), from
    `start` (default: the beginning) to `end` (default: the real end when the scan
    starts), partitions interleaved."""
    parts = [p for p in await partitions_of(settings, topic)
             if partitions is None or p in partitions]  # fmt: skip
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


def _onto(
    latest: dict[bytes, dict[str, Any]],
    records: Iterable[ConsumerRecord[bytes, bytes]],
    keys: Collection[bytes] | None = None,
    shape: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
) -> None:
    """`records` onto the latest JSON object per key, as compaction keeps it: a tombstone
    deletes the key; a value that is not a JSON object is skipped (logged)."""
    for rec in records:
        if rec.key is None or (keys is not None and rec.key not in keys):
            continue
        if rec.value is None:
            latest.pop(rec.key, None)
            continue
        data = json_object(rec.value)
        if data is None:
            log.warning("skipping a value that is not a JSON object at %s/%d/%d",
                        rec.topic, rec.partition, rec.offset)  # fmt: skip
            continue
        kept = data if shape is None else shape(data)
        if kept is not None:
            latest[rec.key] = kept
        else:  # its latest is not wanted: what it was before is not either
            latest.pop(rec.key, None)


async def scan_latest(
    settings: Settings,
    topic: str,
    *,
    keys: Collection[bytes] | None = None,
    shape: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    partitions: Collection[int] | None = None,
) -> dict[bytes, dict[str, Any]]:
    """The latest JSON object per key of `topic`, read whole once (a command): of `keys`
    only, when given; as `shape` makes each latest object, when given (None: the key
    left out); of `partitions` only, when given. It holds what it returns, never the
    topic's records: an operator's lookup of one task in a year of task states held
    every record of them in memory."""
    latest: dict[bytes, dict[str, Any]] = {}
    async for records in scan(settings, topic, partitions=partitions):
        _onto(latest, records, keys, shape)
    return latest


async def latest_of(
    settings: Settings, topic: str, follower: Follower | None = None
) -> dict[bytes, dict[str, Any]]:
    """The latest JSON object per key of `topic`: from `follower` (the worker's, which
    reads only what came since it last did), else read whole once (a command)."""
    return (await latest_of_each(settings, [topic], follower))[topic]


async def latest_of_each(
    settings: Settings, topics: Iterable[str], follower: Follower | None = None
) -> dict[str, dict[bytes, dict[str, Any]]]:
    """`latest_of` each of `topics`, from one read of `follower`'s (else each read whole)."""
    if follower is not None:
        return await follower.latest_each(*topics)
    return {topic: await scan_latest(settings, topic) for topic in topics}


class Follower:
    """The latest JSON object per key of a few small compacted topics (the spend caps, the
    spend under them, the drift baselines), kept by one long-lived reader and admin
    client: each `latest()` reads what came since the last one, to the real end. A worker
    read each of them whole every refresh with an admin client and a consumer made for it
    (bootstrap, metadata, a TLS and SASL handshake each on a secured cluster): 5.5 ms of
    CPU a read, five reads every 30 s, and as many new connections for the brokers. A
    read that fails closes both and starts again from the beginning next time (what the
    caller holds meanwhile is the caller's); a topic not there yet is asked for again."""

    def __init__(self, settings: Settings, topics: Iterable[str]) -> None:
        self.settings = settings
        self._latest: dict[str, dict[bytes, dict[str, Any]]] = {t: {} for t in topics}
        self._parts: dict[str, list[TopicPartition]] = {}
        self._at: dict[TopicPartition, int] = {}  # read up to, per partition
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._stopped = False  # closed for good (the worker stops): no client made again
        # The worker's refreshes run as separate tasks: one read at a time on the consumer
        # (two would re-assign it under each other).
        self._reading = asyncio.Lock()

    async def latest(self, topic: str) -> dict[bytes, dict[str, Any]]:
        return (await self.latest_each(topic))[topic]

    async def latest_each(self, *topics: str) -> dict[str, dict[bytes, dict[str, Any]]]:
        """Each of `topics` (of the followed ones) as it is now, from one read."""
        async with self._reading:
            try:
                await self._read()
            except BaseException:
                await self.close()
                raise
            return {topic: dict(self._latest[topic]) for topic in topics}

    async def _clients(self) -> tuple[AIOKafkaConsumer, AIOKafkaAdminClient]:
        if self._consumer is not None and self._admin is not None:
            return self._consumer, self._admin
        if self._stopped:
            raise RuntimeError("the follower is stopped")
        consumer, client = reader(self.settings, "follow"), admin(self.settings)
        try:
            await client.start()
            await consumer.start()
            if self._stopped:  # stopped while these started: never kept
                raise RuntimeError("the follower is stopped")
        except BaseException:
            await _closed(consumer, client)
            raise
        self._consumer, self._admin = consumer, client
        return consumer, client

    async def _read(self) -> None:
        consumer, client = await self._clients()
        for topic in self._latest:
            if topic not in self._parts:
                found = await partitions_of(self.settings, topic, client)
                if found:
                    self._parts[topic] = [TopicPartition(topic, p) for p in found]
        tps = [tp for parts in self._parts.values() for tp in parts]
        ends = await end_offsets(consumer, tps)
        for tp in tps:
            if self._at.get(tp, 0) > ends[tp]:  # the topic was made again: read it afresh
                self._at = {t: at for t, at in self._at.items() if t.topic != tp.topic}
                self._latest[tp.topic] = {}
        starts = {tp: self._at.get(tp, 0) for tp in tps}
        async for records in read_range(consumer, starts, ends):
            _onto(self._latest[records[0].topic], records)
        self._at.update(ends)
        # Until the next read, nothing assigned: an assigned consumer fetches in the
        # background every fetch wait (100 ms), which tripled an idle worker's CPU (17 ms/s,
        # not 6); paused, its fetcher still cost 1.5 ms/s, unsubscribed 0.03.
        consumer.unsubscribe()

    async def close(self) -> None:
        """Both clients closed; the next read starts from the beginning."""
        consumer, client, self._consumer, self._admin = self._consumer, self._admin, None, None
        self._parts, self._at = {}, {}
        self._latest = {topic: {} for topic in self._latest}
        await _closed(consumer, client)

    async def stop(self) -> None:
        """Closed for good: a read under way fails, none starts again."""
        self._stopped = True
        await self.close()


async def _closed(consumer: AIOKafkaConsumer | None, client: AIOKafkaAdminClient | None) -> None:
    """Both closed, whatever closing one of them raises (a broker away, a client that
    never started)."""
    for close in (consumer.stop if consumer else None, client.close if client else None):
        if close is not None:
            try:
                await close()
            except Exception as exc:
                log.debug("closing a follower's client: %r", exc)
