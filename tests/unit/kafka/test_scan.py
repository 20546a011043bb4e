"""A partition's end is the listed end raised to what a fetch reports (Tansu lists short)."""

from __future__ import annotations

from typing import Any

from aiokafka import TopicPartition

from streams.kafka.scan import end_offsets

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
