"""What the worker changes of Faust's own behaviour, pinned against Faust itself: a
rebalance waits a bounded time for the records taken (Faust's wait has no bound)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import pytest
from faust.types import TP

from streams.settings import load_settings
from streams.worker import faust_private
from streams.worker.app import InLoopApp, ThreadedApp
from streams.worker.eos import Transactions


class Message:
    acked = False


class Consumer:
    """What Faust's `consumer.wait_empty` does: wait while records are unacked."""

    def __init__(self, n: int) -> None:
        self._unacked_messages = {Message() for _ in range(n)}

    async def wait_empty(self) -> None:
        while self._unacked_messages:  # noqa: ASYNC110  # Faust's loop polls, as this one
            await asyncio.sleep(0.01)


async def test_a_rebalance_waits_for_unacked_records_no_longer_than_the_bound() -> None:
    for app_class in (ThreadedApp, InLoopApp):
        app = app_class("bounded-test", broker="kafka://127.0.0.1:1", autodiscover=False)
        app.wait_empty_s = 0.2
        assert app.conf.stream_wait_empty  # Faust's default: the revocation waits
        consumer = Consumer(3)  # three LLM calls that take minutes
        started = time.monotonic()
        await asyncio.wait_for(
            app._consumer_wait_empty(consumer, logging.getLogger("test")), 5
        )  # Faust's own method, which calls consumer.wait_empty
        assert consumer._unacked_messages == set()  # left: their offsets stay uncommitted
        assert time.monotonic() - started >= 0.2


async def test_records_acked_within_the_bound_are_waited_for_as_faust_does() -> None:
    app = InLoopApp("bounded-test-2", broker="kafka://127.0.0.1:1", autodiscover=False)
    app.wait_empty_s = 30
    consumer = Consumer(1)
    message = next(iter(consumer._unacked_messages))

    async def ack_soon() -> None:
        await asyncio.sleep(0.05)
        consumer._unacked_messages.discard(message)

    acking = asyncio.create_task(ack_soon())
    await asyncio.wait_for(app._consumer_wait_empty(consumer, logging.getLogger("t")), 5)
    await acking
    assert consumer._unacked_messages == set()


async def test_what_the_status_reads_of_faust_is_where_faust_keeps_it() -> None:
    """`stream_state` reads Faust's committed offsets, its paused partitions and each
    stream's channel queue; `send` the aiokafka producer under Faust's: an upgrade that
    moves one fails here, not as a status page that says nothing."""
    app = InLoopApp("status-test", broker="kafka://127.0.0.1:1", autodiscover=False)
    consumer = app.consumer
    assert isinstance(consumer._committed_offset, Mapping)
    assert isinstance(consumer._buffered_partitions, set)
    assert app.producer._producer is None  # made when Faust's producer starts
    stream = app.stream(app.topic("tasks", key_serializer="raw", value_serializer="raw"))
    assert stream.channel.queue.qsize() == 0
    tp = TP("tasks", 0)
    consumer._committed_offset[tp] = 7
    consumer._buffered_partitions.add(tp)
    consumer.assignment = lambda: {tp}  # type: ignore[method-assign]  # not started here
    consumer.highwater = lambda _tp: 10  # type: ignore[method-assign]
    assert faust_private.stream_state(consumer, [stream]) == {
        "lag": {("tasks", 0): 3}, "paused": 1, "buffered": 0,
    }  # fmt: skip


async def test_exactly_once_commits_source_offsets_as_faust_does_and_task_offsets_not() -> None:
    """The task topics' offsets go with their partitions' transactions; a source topic's
    (no task partition: its forwards are written outside the transactions) through Faust's
    own commit, or they would never be committed at all."""
    settings = load_settings(processing_guarantee="exactly_once")
    committed: list[dict[TP, int]] = []

    class Consumer:
        async def _commit(self, offsets: Mapping[TP, int]) -> bool:
            committed.append(dict(offsets))
            return True

    consumer = Consumer()
    eos = Transactions(settings)
    eos.hook_consumer(consumer)
    eos.hook_consumer(consumer)  # every rebalance hooks it: once is what counts
    tasks, source = TP(settings.topics.tasks, 0), TP("shop.reviews", 0)
    assert await consumer._commit({tasks: 5, source: 7})
    assert committed == [{source: 7}]
    assert await consumer._commit({TP(settings.topics.replay, 1): 3})
    assert committed == [{source: 7}]  # nothing of a source: Faust's commit not called


async def test_a_transactional_producers_fatal_error_is_read_where_aiokafka_keeps_it() -> None:
    """`transaction_failed` reads aiokafka's own producer: None while it can go on, the
    error its dead sender left once it cannot (pinned: an aiokafka that moves it fails
    here)."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import ProducerFenced

    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", transactional_id="app-eos-0")
    try:
        assert faust_private.transaction_failed(producer) is None
        producer._txn_manager.set_pid_and_epoch(7, 0)
        producer._txn_manager.begin_transaction()
        assert faust_private.transaction_failed(producer) is None
        producer._txn_manager.fatal_error(ProducerFenced())
        assert isinstance(faust_private.transaction_failed(producer), ProducerFenced)
    finally:
        await producer.stop()  # never started: closes nothing


def test_faust_draws_its_commit_table_only_when_the_line_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Faust's consumer reaches `terminal.logtable` through its module at each commit; once
    the worker's app is made, the table it gets is drawn only when turned into text (the
    log line written), and is then Faust's own table."""
    from faust.transport import consumer as faust_consumer_module
    from faust.utils import terminal

    monkeypatch.setattr(faust_consumer_module, "terminal", terminal)  # undone after the test
    drawn: list[object] = []
    real = faust_private._logtable

    def counted(*args: object, **kwargs: object) -> object:
        drawn.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(faust_private, "_logtable", counted)
    faust_private.commit_table_when_logged()
    rows = [("tasks-0", "12")]
    table = faust_consumer_module.terminal.logtable(rows, title="Commit Offsets",
                                                    headers=["TP", "Offset"])  # fmt: skip
    assert drawn == []  # made, not drawn
    text = str(table)
    assert drawn and "Commit Offsets" in text and "tasks-0" in text and "12" in text
    assert text == str(real(rows, title="Commit Offsets", headers=["TP", "Offset"]))
