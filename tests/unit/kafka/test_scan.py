"""A partition's end is the listed end raised to what a fetch reports (Tansu lists short)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiokafka import TopicPartition

from streams.kafka.scan import end_offsets
from streams.settings import load_settings

A, B = TopicPartition("t", 0), TopicPartition("t", 1)


class ShortListing:
    """A consumer whose ListOffsets answer is short of the real end (as Tansu's can be)
    while its fetches report the real high watermark and last stable offset."""

    def __init__(self, listed: dict[TopicPartition, int], high: dict[TopicPartition, int],
                 stable: dict[TopicPartition, int | None]) -> None:  # fmt: skip
        self.listed, self.high, self.stable = listed, high, stable
        self.fetched: set[TopicPartition] = set()
        self.positions: dict[TopicPartition, int] = {}

    def assign(self, tps: list[TopicPartition]) -> None:
        self.fetched.clear()

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.listed[tp] for tp in tps}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp] = offset

    async def getmany(self, *tps: TopicPartition, timeout_ms: int = 0) -> dict[Any, Any]:
        self.fetched.update(tps)
        return {}

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.high[tp] if tp in self.fetched else None

    def last_stable_offset(self, tp: TopicPartition) -> int | None:
        return self.stable[tp] if tp in self.fetched else None


async def test_the_end_is_what_a_fetch_reports_when_the_listing_is_short() -> None:
    consumer: Any = ShortListing({A: 19_969, B: 0}, {A: 20_000, B: 31}, {A: None, B: None})
    assert await end_offsets(consumer, [A, B], read_committed=False) == {A: 20_000, B: 31}


async def test_a_read_committed_reader_ends_at_the_last_stable_offset() -> None:
    consumer: Any = ShortListing({A: 10, B: 5}, {A: 20, B: 5}, {A: 15, B: None})
    assert await end_offsets(consumer, [A, B]) == {A: 15, B: 5}


async def test_a_listing_never_lowers_the_end() -> None:
    consumer: Any = ShortListing({A: 50}, {A: 40}, {A: None})
    assert await end_offsets(consumer, [A], read_committed=False) == {A: 50}


# -- the worker's follower of its small compacted topics ---------------------------------


class Log:
    """The broker's side for a follower: records per partition, and what was fetched."""

    def __init__(self) -> None:
        self.records: dict[TopicPartition, list[Any]] = {}
        self.fetched = 0  # records handed to any reader
        self.made: list[Any] = []  # every client made, in order
        self.fail: Exception | None = None  # the next fetch raises this
        self.gate: asyncio.Event | None = None  # clients' starts wait for it
        self.starting = asyncio.Event()  # a client's start began
        self.open_reads = self.most_open_reads = 0  # reads between assign and unsubscribe

    def write(self, tp: TopicPartition, key: bytes, value: Any) -> None:
        from aiokafka.structs import ConsumerRecord

        log = self.records.setdefault(tp, [])
        raw = None if value is None else orjson.dumps(value)
        log.append(ConsumerRecord(tp.topic, tp.partition, len(log), 0, 0, key, raw, None,
                                  len(key), len(raw or b""), ()))  # fmt: skip


class LogReader:
    def __init__(self, log: Log) -> None:
        self.log, self.at, self.stopped = log, {}, False
        log.made.append(self)

    async def start(self) -> None:
        self.log.starting.set()
        if self.log.gate is not None:
            await self.log.gate.wait()

    async def stop(self) -> None:
        self.stopped = True

    async def close(self) -> None:  # as an admin client closes
        self.stopped = True

    def assign(self, tps: list[TopicPartition]) -> None:
        if not self.at:
            self.log.open_reads += 1
            self.log.most_open_reads = max(self.log.most_open_reads, self.log.open_reads)
        self.at = {tp: self.at.get(tp, 0) for tp in tps}

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        await asyncio.sleep(0)  # a request to the broker: other tasks run meanwhile
        return {tp: len(self.log.records.get(tp, [])) for tp in tps}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.at[tp] = offset

    def unsubscribe(self) -> None:
        self.log.open_reads -= 1
        self.at = {}

    async def getmany(self, *tps: TopicPartition, timeout_ms: int = 0,
                      max_records: int | None = None) -> dict[Any, Any]:  # fmt: skip
        if self.log.fail is not None:
            raise self.log.fail
        out = {}
        for tp in tps:
            records = self.log.records.get(tp, [])[self.at[tp] :]
            if records:
                out[tp] = records
                self.at[tp] += len(records)
                self.log.fetched += len(records)
        return out

    def highwater(self, tp: TopicPartition) -> int | None:
        return len(self.log.records.get(tp, []))

    def last_stable_offset(self, tp: TopicPartition) -> int | None:
        return None

    async def position(self, tp: TopicPartition) -> int:
        return int(self.at[tp])


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Log:
    from streams.kafka import scan

    log = Log()
    monkeypatch.setattr(scan, "reader", lambda settings, purpose: LogReader(log))
    monkeypatch.setattr(scan, "admin", lambda settings: LogReader(log))

    async def partitions_of(settings: Any, topic: str, client: Any = None) -> list[int]:
        return sorted({tp.partition for tp in log.records if tp.topic == topic})

    monkeypatch.setattr(scan, "partitions_of", partitions_of)
    return log


CAPS = TopicPartition("caps", 0)


async def test_a_follower_reads_only_what_came_since_its_last_read(log: Log) -> None:
    from streams.kafka.scan import Follower

    for i in range(50):
        log.write(CAPS, f"p{i % 5}".encode(), {"n": i})
    follower = Follower(load_settings(), ["caps", "spend"])
    assert await follower.latest("caps") == {f"p{i}".encode(): {"n": 45 + i} for i in range(5)}
    assert await follower.latest("spend") == {} and log.fetched == 50
    log.write(CAPS, b"p0", None)  # a tombstone
    log.write(CAPS, b"p1", {"n": 99})
    assert await follower.latest("caps") == {b"p1": {"n": 99}, b"p2": {"n": 47},
                                             b"p3": {"n": 48}, b"p4": {"n": 49}}  # fmt: skip
    assert log.fetched == 52 and len(log.made) == 2  # the two new records, the same clients
    assert log.made[0].at == {}  # nothing assigned, nothing fetched until the next read
    await follower.stop()
    assert all(client.stopped for client in log.made)


async def test_reads_asked_for_at_once_share_the_clients_one_at_a_time(log: Log) -> None:
    """The worker's budget and drift refreshes are separate tasks: asking together, they
    get one pair of clients and one read on the consumer at a time."""
    from streams.kafka.scan import Follower

    log.write(CAPS, b"p", {"n": 1})
    log.write(TopicPartition("spend", 0), b"s", {"n": 2})
    follower = Follower(load_settings(), ["caps", "spend"])
    caps, spend = await asyncio.gather(follower.latest("caps"), follower.latest("spend"))
    assert caps == {b"p": {"n": 1}} and spend == {b"s": {"n": 2}}
    assert len(log.made) == 2 and log.most_open_reads == 1 and log.open_reads == 0
    await follower.stop()


async def test_a_topic_whose_end_is_below_the_followers_place_is_read_afresh(log: Log) -> None:
    """A topic deleted and made again starts its offsets over, below where the follower
    had read to: what it held of that topic goes, the new records are read from 0."""
    from streams.kafka.scan import Follower

    for i in range(5):
        log.write(CAPS, f"p{i}".encode(), {"n": i})
    follower = Follower(load_settings(), ["caps"])
    assert len(await follower.latest("caps")) == 5
    log.records[CAPS] = []
    log.write(CAPS, b"q", {"n": 9})
    assert await follower.latest("caps") == {b"q": {"n": 9}}
    await follower.stop()


async def test_a_failed_read_closes_the_clients_and_the_next_starts_afresh(log: Log) -> None:
    from aiokafka.errors import KafkaConnectionError

    from streams.kafka.scan import Follower

    log.write(CAPS, b"p", {"n": 1})
    follower = Follower(load_settings(), ["caps"])
    assert await follower.latest("caps") == {b"p": {"n": 1}}
    log.write(CAPS, b"p", {"n": 2})
    log.fail = KafkaConnectionError("broker away")
    with pytest.raises(KafkaConnectionError):
        await follower.latest("caps")
    assert all(client.stopped for client in log.made)
    log.fail = None
    assert await follower.latest("caps") == {b"p": {"n": 2}}
    assert len(log.made) == 4 and log.fetched == 1 + 2  # new clients, all read again
    await follower.stop()


async def test_a_follower_stopped_while_its_clients_start_keeps_none(log: Log) -> None:
    """The worker stops while a refresh is making the follower's clients: they are
    closed, and no read makes them again."""
    from streams.kafka.scan import Follower

    log.gate = asyncio.Event()
    follower = Follower(load_settings(), ["caps"])
    first = asyncio.create_task(follower.latest("caps"))
    await log.starting.wait()
    await follower.stop()
    log.gate.set()
    with pytest.raises(RuntimeError, match="stopped"):
        await first
    assert log.made and all(client.stopped for client in log.made)
    with pytest.raises(RuntimeError, match="stopped"):
        await follower.latest("caps")
