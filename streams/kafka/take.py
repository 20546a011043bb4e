"""Micro-batches of a Faust stream that cost nothing while nothing comes.

Faust's `Stream.noack_take(max_, within)` wakes every `within` seconds whether its
buffer holds anything or not, and each wake-up is one of mode's `wait_first`
(three tasks and a timer). With one agent per lane and a 50 ms window, an idle
worker woke ~500 times a second for nothing, and a thin stream paid those wake-ups
per task. Faust offers no take that waits for its first record, so this is that
take, written the way Faust's is (a stream processor fills the buffer; the stream
is drained passively; events are not acked): it sleeps, with no timer, until a
record comes, then waits at most `within` for the batch to fill (Kafka's
`linger.ms`), and yields it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import faust

from streams.kafka import faust_private

log = logging.getLogger(__name__)


async def take(stream: faust.Stream[Any], max_: int, within: float) -> AsyncIterator[list[Any]]:
    """Lists of up to `max_` events of `stream` (not acked): each yielded once it is full,
    or `within` seconds after its first event came."""
    buffer: list[Any] = []
    arrived = asyncio.Event()  # the buffer holds a first event
    full = asyncio.Event()
    consumed = asyncio.Event()
    consuming: asyncio.Future[None] | None = None  # set while a batch is being handled

    async def add(value: Any) -> Any:
        nonlocal consuming
        try:
            if consuming is not None:  # a batch is out: the next one waits for it
                try:
                    await consuming
                finally:
                    consuming = None
            event = stream.current_event
            if event is None:
                raise RuntimeError("take found no current event")
            buffer.append(event)
            arrived.set()
            if len(buffer) >= max_:  # no more than `max_`: wait until this one is out
                full.set()
                consumed.clear()
                await stream.wait(consumed)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # as Faust's take: the stream crashes, not silently stalls
            log.exception("could not add to the take buffer: %r", exc)
            await stream.crash(exc)
        return value

    acks = stream.enable_acks
    stream.enable_acks = False  # acked by the caller, once each task is done
    stream.add_processor(add)
    faust_private.drain_passively(stream)
    try:
        while not stream.should_stop:
            # (Both return at once when the stream stops; the loop then ends.)
            await stream.wait_for_stopped(arrived)  # type: ignore[arg-type]
            await stream.wait_for_stopped(full, timeout=within)  # type: ignore[arg-type]
            if not buffer:
                continue
            consuming = asyncio.get_running_loop().create_future()
            try:
                yield list(buffer)
            finally:
                buffer.clear()
                arrived.clear()
                full.clear()
                consumed.set()
                if not consuming.done():
                    consuming.set_result(None)
    finally:
        stream.enable_acks = acks
        faust_private.remove_processor(stream, add)
