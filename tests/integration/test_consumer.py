"""The worker consumer's seeks against a real broker (streams.worker.faust_private)."""

from __future__ import annotations

from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from streams.kafka import clients
from streams.worker import faust_private
from tests.integration.helpers import produce


async def _offsets_read(consumer: Any, tp: TopicPartition, at_least: int) -> list[int]:
    read: list[int] = []
    for _ in range(50):
        batch = await consumer.getmany(tp, timeout_ms=500)
        read += [record.offset for record in batch.get(tp, [])]
        if len(read) >= at_least:
            break
    return read


async def test_a_seek_back_puts_a_partition_never_committed_at_its_start(
    make_settings: Any,
) -> None:
    """Faust seeks back to the committed offsets to read again what it fetched and
    dropped (a rebalance, a fetch answered while the flow is stopped). A partition with
    nothing committed yet went nowhere (aiokafka seeks only where an offset above 0 is
    committed): the records fetched and dropped were never read again."""
    settings = make_settings(kafka={"partitions": 1})
    where = await produce(settings, [(b"task-%d" % i, b"{}") for i in range(8)])
    tp = TopicPartition(settings.topics.tasks, where[0][0])
    consumer = clients.consumer(
        settings, settings.topics.tasks, purpose="test", group_id=settings.app_id,
        enable_auto_commit=False, auto_offset_reset="earliest",
    )  # fmt: skip
    await consumer.start()
    try:
        assert await _offsets_read(consumer, tp, 8) == list(range(8))  # fetched, then dropped
        committed = await faust_private.seek_from_committed(consumer)
        assert committed == {tp: None}
        assert await _offsets_read(consumer, tp, 8) == list(range(8))  # read again, all
        # Where an offset is committed, back to it, as before.
        await consumer.commit({tp: OffsetAndMetadata(5, "")})
        assert await faust_private.seek_from_committed(consumer) == {tp: 5}
        assert await _offsets_read(consumer, tp, 3) == [5, 6, 7]
    finally:
        await consumer.stop()
