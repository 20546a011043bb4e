"""Micro-batches of a Faust stream that cost nothing while nothing comes.

Faust's `Stream.noack_take(max_, within)` wakes every `within` seconds whether its
buffer holds anything or not, and each wake-up is one of mode's `wait_first`
(three tasks and a timer). With one agent per lane and a 50 ms window, an idle
worker woke ~500 times a second for nothing, and a thin stream paid those wake-ups
per task. Faust offers no take that waits for its first record, so this is that
take, written the way Faust's is (a stream processor fills the buffer; the stream
is drained passively; events are not acked): it sleeps, with no timer, until a
record comes, then waits at most `within` for the batch to fill (Kafka's
`linger.ms`), and yields it. A wait is one future (and the window one timer), not
mode's `wait_first`: a thin stream pays the take per record.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import faust

from streams.worker import faust_private

log = logging.getLogger(__name__)


class _Batch:
    """The batch being filled, and the one future the take waits on: woken by the
    batch's first event, a full batch, the window's end or the stream's end — one future
    (and one timer for the window) per wait, not mode's `wait_first` (three tasks, an
    `asyncio.wait` and their cancels)."""

    def __init__(self, stream: faust.Stream[Any], max_: int) -> None:
        self.stream, self.max_ = stream, max_
        self.loop = asyncio.get_running_loop()
        self.events: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None
        self._consumed = asyncio.Event()
        self.consuming: asyncio.Future[None] | None = None  # set while a batch is out

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, within: float | None = None) -> None:
        """Until `wake()`, or at most `within` seconds."""
        self._waiter = self.loop.create_future()
        timer = self.loop.call_later(within, self.wake) if within is not None else None
        try:
            await self._waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def add(self, value: Any) -> Any:
        """The stream's processor: each event into the batch."""
        try:
            if self.consuming is not None:  # a batch is out: the next one waits for it
                try:
                    await self.consuming
                finally:
                    self.consuming = None
            event = self.stream.current_event
            if event is None:
                raise RuntimeError("take found no current event")
            self.events.append(event)
            full = len(self.events) >= self.max_
            if full or len(self.events) == 1:  # the batch's first, or full
                self.wake()
            if full:  # no more than `max_`: wait until this one is out
                self._consumed.clear()
                await self.stream.wait(self._consumed)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # as Faust's take: the stream crashes, not silently stalls
            log.exception("could not add to the take buffer: %r", exc)
            await self.stream.crash(exc)
        return value

    def handed_out(self) -> None:
        """The batch yielded is done with: the next one may fill."""
        self.events.clear()
        self._consumed.set()
        if self.consuming is not None and not self.consuming.done():
            self.consuming.set_result(None)


async def take(
    stream: faust.Stream[Any],
    max_: int,
    within: float,
    eager: Callable[[], bool] | None = None,
) -> AsyncIterator[list[Any]]:
    """Lists of up to `max_` events of `stream` (not acked): each yielded once it is full,
    or `within` seconds after its first event came — or at once, what has come so far,
    while `eager()` says its events can start now (the worker has free slots): the
    window bounds how long a batch waits for company when there is no room for it
    anyway, never how long a record waits while its call could start."""
    batch = _Batch(stream, max_)
    acks = stream.enable_acks
    stream.enable_acks = False  # acked by the caller, once each task is done
    stream.add_processor(batch.add)
    faust_private.drain_passively(stream)
    # The stream's stop or crash wakes the take: one task for the take's whole life.
    ended = asyncio.ensure_future(stream.wait())
    ended.add_done_callback(lambda _: batch.wake())
    try:
        while not ended.done():
            if not batch.events:
                await batch.wait()  # until the batch's first event (or the end)
            if batch.events and len(batch.events) < max_ and not ended.done():
                if eager is None or not eager():
                    await batch.wait(within)  # until full or the window ends (or the end)
                else:
                    await asyncio.sleep(0)  # what came with it this turn goes along
            if not batch.events:
                continue
            batch.consuming = batch.loop.create_future()
            try:
                yield list(batch.events)
            finally:
                batch.handed_out()
    finally:
        ended.cancel()
        stream.enable_acks = acks
        faust_private.remove_processor(stream, batch.add)
