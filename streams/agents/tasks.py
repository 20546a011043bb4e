"""The task agent: micro-batches in, one result or dead letter out per record.

Offset safety: the stream runs without automatic acks (`noack_take`). An
event counts as finished once its result or dead letter is acknowledged by
the broker, and finished events are acked to Faust in arrival order per
partition (`InOrderAcks`), so Faust's commit never passes a record still in
flight, however many run concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import faust
from aiokafka.errors import KafkaError

from streams.metrics import Metrics
from streams.processing.dispatch import Dispatcher
from streams.processing.offsets import InOrderAcks, Ticket
from streams.processing.processor import Outcome, TaskProcessor
from streams.records import Source
from streams.resilience.limiter import Lane
from streams.settings import Settings

log = logging.getLogger(__name__)

SEND_ATTEMPTS = 8


class TaskAgent:
    """Owns the agent's topics and the per-worker processor and dispatcher."""

    def __init__(
        self,
        app: faust.App,
        settings: Settings,
        make_processor: Callable[[], TaskProcessor],
        metrics: Metrics | None = None,
    ) -> None:
        self.app = app
        self.settings = settings
        self.make_processor = make_processor
        self.metrics = metrics or Metrics()
        self._stream: faust.Stream[Any] | None = None
        # internal=True: Faust creates missing topics with the configured partitions.
        raw: dict[str, Any] = {"key_serializer": "raw", "value_serializer": "raw", "internal": True}
        # One agent reads both lanes; the limiter serves live before replay.
        self.tasks_topic = app.topic(settings.topics.tasks, settings.topics.replay, **raw)
        self.results_topic = app.topic(settings.topics.results, compacting=True, **raw)
        self.dead_letter_topic = app.topic(settings.topics.dead_letters, **raw)
        self.acks: InOrderAcks[Any] = InOrderAcks()
        self.agent = app.agent(self.tasks_topic, name="llm-streams.tasks")(self.run)  # type: ignore[arg-type]  # faust types the param as StreamT
        self.metrics.watch_stream(self.stream_state)

    def stream_state(self) -> dict[str, Any]:
        """Lag per partition, partitions paused by backpressure, records buffered."""
        consumer = self.app.consumer
        # Faust keeps committed offsets and paused partitions with no public accessor.
        committed_offsets = getattr(consumer, "_committed_offset", {})
        lag: dict[tuple[str, int], int] = {}
        for tp in consumer.assignment():
            highwater = consumer.highwater(tp)
            if highwater is None:
                continue
            committed = committed_offsets.get(tp)
            lag[(tp.topic, tp.partition)] = max(0, highwater - (committed or 0))
        stream = self._stream
        return {
            "lag": lag,
            "paused": len(getattr(consumer, "_buffered_partitions", ())),
            "buffered": cast(Any, stream.channel).queue.qsize() if stream is not None else 0,
        }

    def lane_of(self, topic: str) -> Lane:
        return Lane.REPLAY if topic == self.settings.topics.replay else Lane.LIVE

    async def run(self, stream: faust.Stream[Any]) -> None:
        settings = self.settings
        await self.results_topic.maybe_declare()
        await self.dead_letter_topic.maybe_declare()
        processor = self.make_processor()
        dispatcher = Dispatcher(settings.batch.concurrency)
        self._stream = stream
        m = self.metrics
        try:
            waiting_since = time.monotonic()
            async for events in stream.noack_take(
                settings.batch.size, within=settings.batch.window_s
            ):
                m.batch_size.observe(len(events))
                m.batch_fill.observe(time.monotonic() - waiting_since)
                for event in events:
                    message = event.message
                    m.tasks_received.labels(self.lane_of(message.topic).name.lower()).inc()
                    m.unfinished.inc()
                    order_key = (
                        message.key.decode(errors="replace")
                        if message.key
                        else f"{message.tp.partition}/{message.offset}"
                    )
                    ticket = self.acks.started(message.tp, event)
                    await dispatcher.submit(
                        order_key, self._job(stream, ticket, processor, time.monotonic())
                    )
                waiting_since = time.monotonic()
        finally:
            try:
                await asyncio.wait_for(asyncio.shield(dispatcher.drain()), timeout=5)
            except (TimeoutError, asyncio.CancelledError):
                await dispatcher.cancel()
            await processor.close()

    def _job(
        self,
        stream: faust.Stream[Any],
        ticket: Ticket[Any],
        processor: TaskProcessor,
        taken_at: float,
    ) -> Callable[[], Any]:
        async def job() -> None:
            m = self.metrics
            message = ticket.item.message
            source = Source(topic=message.topic, partition=message.partition, offset=message.offset)
            lane = self.lane_of(message.topic)
            lane_name = lane.name.lower()
            m.queue_wait.labels(lane_name).observe(time.monotonic() - taken_at)
            m.in_flight.inc()
            try:
                outcome = await processor.process(message.value, message.key, source, lane)
                await self._deliver(outcome)
            finally:
                m.in_flight.dec()
            m.tasks_completed.labels(lane_name, outcome.kind).inc()
            if outcome.category is not None:
                m.dead_letters.labels(outcome.category).inc()
            if message.timestamp:  # seconds since the epoch, set by the producer or broker
                m.end_to_end.labels(lane_name, outcome.kind).observe(
                    max(0.0, time.time() - message.timestamp)
                )
            for event in self.acks.finished(ticket):
                await stream.ack(event)
                m.unfinished.dec()

        return job

    async def _deliver(self, outcome: Outcome) -> None:
        """Write the outcome and wait for the broker's ack; retry sends, then crash."""
        topic = self.results_topic if outcome.kind == "result" else self.dead_letter_topic
        delay = 0.1
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                pending = await topic.send(key=outcome.key.encode(), value=outcome.value)
                await pending
                return
            except KafkaError as exc:
                if attempt == SEND_ATTEMPTS:
                    log.critical(
                        "cannot write %s %s: %r; stopping the worker",
                        outcome.kind,
                        outcome.key,
                        exc,
                    )
                    # The record stays unacked, so it is processed again after the restart.
                    await self.app.crash(exc)
                    raise
                log.warning(
                    "send of %s failed (%r); retry %d in %.1fs", outcome.key, exc, attempt, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
