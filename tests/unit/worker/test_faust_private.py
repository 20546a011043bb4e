"""What the worker changes of Faust's own behaviour, pinned against Faust itself: a
rebalance waits a bounded time for the records taken (Faust's wait has no bound)."""

from __future__ import annotations

import asyncio
import logging
import time

from streams.worker.app import InLoopApp, ThreadedApp


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
