"""The task agent: micro-batches in, one result or dead letter out per record.

Offset safety: the stream runs without automatic acks (`noack_take`). An
event counts as finished once its result or dead letter is acknowledged by
the broker, and finished events are acked to Faust in arrival order per
partition (`InOrderAcks`), so Faust's commit never passes a record still in
flight, however many run concurrently.

Outcomes are written through the state tables (`streams.state`): the results
and dead-letter topics are the changelogs of the results and dead-letter
tables, so a record that runs again (after a crash or a rebalance) finds its
answer there and writes nothing; a new record for an answered task gets the
stored answer back (`cached: true`), and identical inputs of different tasks
share one LLM call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import faust
import orjson
from aiokafka.errors import KafkaError

from streams.metrics import Metrics
from streams.processing.dispatch import Dispatcher
from streams.processing.offsets import InOrderAcks, StreamGuard, Ticket
from streams.processing.processor import Outcome, Prepared, TaskProcessor
from streams.records import Source
from streams.resilience.limiter import Lane
from streams.settings import Settings
from streams.state import ContentCache, StateTables, Status, TaskState, make_current

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
        parts: dict[str, Any] = {**raw, "partitions": settings.kafka.partitions}
        self.results_topic = app.topic(settings.topics.results, compacting=True, **parts)
        self.dead_letter_topic = app.topic(settings.topics.dead_letters, **parts)
        self.state_topic = app.topic(
            f"{settings.app_id}-task-state-changelog", compacting=True, **parts
        )
        self.tables = StateTables(
            app,
            results_topic=self.results_topic,
            dead_letter_topic=self.dead_letter_topic,
            state_topic=self.state_topic,
            partitions=settings.kafka.partitions,
        )
        self.cache = ContentCache()
        self.acks: InOrderAcks[Any] = InOrderAcks()
        self.guard: StreamGuard[Any] = StreamGuard()
        self._faust_add_gap: Callable[[Any, int, int], Awaitable[None]] | None = None
        self.agent = app.agent(self.tasks_topic, name="llm-streams.tasks")(self.run)  # type: ignore[arg-type]  # faust types the param as StreamT
        self.metrics.watch_stream(self.stream_state)

    def stream_state(self) -> dict[str, Any]:
        """Lag per partition, partitions paused by backpressure, records buffered."""
        consumer = self.app.consumer
        # Faust keeps committed offsets and paused partitions with no public accessor.
        committed_offsets = getattr(consumer, "_committed_offset", {})
        lag: dict[tuple[str, int], int] = {}
        inputs = {self.settings.topics.tasks, self.settings.topics.replay}
        for tp in consumer.assignment():
            if tp.topic not in inputs:  # table changelogs are read only to recover
                continue
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

    def _take_over_gaps(self) -> None:
        """Keep Faust from treating a jump in our input offsets as a gap.

        Faust 0.15.3's fetcher marks offsets it jumped over as gaps and commits past
        them; it jumps over records it never delivered, too (see `StreamGuard`), and a
        kill before they run again loses them. For the task topics the guard seeks back
        instead and hands Faust only the offsets it confirmed empty. (Private Faust API,
        kept to this one place.)
        """
        consumer: Any = self.app.consumer
        original = getattr(consumer, "_llm_streams_add_gap", None) or consumer._add_gap
        inputs = {self.settings.topics.tasks, self.settings.topics.replay}

        async def add_gap(tp: Any, offset_from: int, offset_to: int) -> None:
            if tp.topic not in inputs:
                await original(tp, offset_from, offset_to)

        self._faust_add_gap = original
        consumer._llm_streams_add_gap = original
        consumer._add_gap = add_gap

    async def _seek_unfilled_holes(self, every_s: float = 1.0, after_s: float = 2.0) -> None:
        """Seek again over holes a first seek did not fill (runs beside the agent loop,
        which may be blocked on a full dispatcher)."""
        while True:
            await asyncio.sleep(every_s)
            for tp, offset in self.guard.unfilled(time.monotonic(), after_s):
                log.warning("%s: offset %d still missing; seeking back again", tp, offset)
                try:
                    await self.app.consumer.seek(cast(Any, tp), offset)
                except Exception as exc:  # not assigned any more, consumer restarting
                    log.warning("seek of %s to %d failed: %r", tp, offset, exc)

    async def _admit(self, stream: faust.Stream[Any], event: Any) -> bool:
        """Should the agent process this record? Duplicates are not processed (acked
        after their original); a hole before it makes the consumer seek back."""
        message = event.message
        tp = message.tp
        consumer = self.app.consumer
        committed = getattr(consumer, "_committed_offset", {}).get(tp)
        admission = self.guard.admit(tp, message.offset, event, committed, time.monotonic())
        for first, last in admission.gaps:  # confirmed empty: Faust may commit past them
            if self._faust_add_gap is not None:
                await self._faust_add_gap(tp, first, last)
        if admission.duplicate:
            self.metrics.redelivered.inc()
            if admission.ack_now:
                await stream.ack(event)
            return False
        if admission.seek_to is not None:
            log.warning(
                "%s: offsets %d..%d were never delivered; seeking back to %d",
                tp, admission.seek_to, message.offset - 1, admission.seek_to,
            )  # fmt: skip
            self.metrics.stream_holes.inc()
            await consumer.seek(tp, admission.seek_to)
        if committed is not None and message.offset % 500 == 0:
            self.guard.prune(tp, committed)
        return True

    def lane_of(self, topic: str) -> Lane:
        return Lane.REPLAY if topic == self.settings.topics.replay else Lane.LIVE

    async def run(self, stream: faust.Stream[Any]) -> None:
        settings = self.settings
        processor = self.make_processor()
        dispatcher = Dispatcher(settings.batch.concurrency)
        self._stream = stream
        self._take_over_gaps()
        healer = asyncio.create_task(self._seek_unfilled_holes())
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
                    if not await self._admit(stream, event):
                        continue
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
            healer.cancel()
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
            try:
                await run()
            except Exception as exc:
                # Not a task's fault (the processor turns those into dead letters): the
                # tables or the broker. The record stays unacked, and a worker that kept
                # going would stall its partition's commits; stop and run it again.
                log.critical("job for %s failed: %r; stopping the worker", ticket.item, exc)
                await self.app.crash(exc)
                raise

        async def run() -> None:
            m = self.metrics
            event = ticket.item
            make_current(event)  # table writes go to this record's partition
            message = event.message
            source = Source(topic=message.topic, partition=message.partition, offset=message.offset)
            lane = self.lane_of(message.topic)
            lane_name = lane.name.lower()
            m.queue_wait.labels(lane_name).observe(time.monotonic() - taken_at)
            m.in_flight.inc()
            try:
                prepared = processor.prepare(message.value, message.key, source)
                if isinstance(prepared, Outcome):  # bad input: a dead letter, unless written
                    outcome: Outcome | None = prepared
                    if self._written(self.tables.dead_letters, prepared.key, source):
                        outcome = None
                    else:
                        await self._deliver(prepared, None, source)
                else:
                    outcome, written = await self._answer(prepared, processor, lane)
                    if not written:
                        await self._deliver(outcome, prepared, source)
                    elif self._state_missing(prepared, outcome):
                        # Written by a run killed before its state was: write that now.
                        state = self._state_after(outcome, prepared, source)
                        await self.tables.put_state(state)
                    if written:
                        outcome = None
            finally:
                m.in_flight.dec()
            kind = outcome.kind if outcome is not None else "already_done"
            m.tasks_completed.labels(lane_name, kind).inc()
            if outcome is not None and outcome.category is not None:
                m.dead_letters.labels(outcome.category).inc()
            if message.timestamp:  # seconds since the epoch, set by the producer or broker
                m.end_to_end.labels(lane_name, kind).observe(
                    max(0.0, time.time() - message.timestamp)
                )
            for done in self.acks.finished(ticket):
                await stream.ack(done)
                m.unfinished.dec()
                for duplicate in self.guard.acked(done.message.tp, done.message.offset):
                    await stream.ack(duplicate)

        return job

    async def _answer(
        self, prep: Prepared, processor: TaskProcessor, lane: Lane
    ) -> tuple[Outcome, bool]:
        """The outcome of a valid task, and whether an earlier run of this very record
        (before a crash or rebalance) already wrote it."""
        tables = self.tables
        stored = tables.results.get(prep.result_key.encode())
        if stored is not None:
            earlier = orjson.loads(stored)
            if earlier.get("source") == prep.source.model_dump():
                return self._stored(prep, "result", prep.result_key, stored, earlier), True
            # Answered before for another record of the task: the answer, without a call.
            self.metrics.cache_hits.labels(prep.pipeline.name, "result").inc()
            return processor.from_cache(prep, earlier["output"], earlier["model"]), False
        dead = tables.dead_letters.get(prep.task.task_id.encode())
        if dead is not None:
            letter = orjson.loads(dead)
            if letter.get("source") == prep.source.model_dump():
                return self._stored(prep, "dead_letter", prep.task.task_id, dead, letter), True

        async def call() -> tuple[Outcome, tuple[dict[str, Any], str] | None]:
            outcome = await processor.answer(prep, lane)
            if outcome.kind == "result" and outcome.output is not None and outcome.model:
                return outcome, (outcome.output, outcome.model)
            return outcome, None

        value, shared = await self.cache.shared(prep.content_key, call)
        if shared:  # an identical input of another task was answered (or in flight)
            output, model = value
            self.metrics.cache_hits.labels(prep.pipeline.name, "content").inc()
            return processor.from_cache(prep, output, model), False
        return cast(Outcome, value), False

    @staticmethod
    def _stored(prep: Prepared, kind: str, key: str, raw: bytes, record: dict[str, Any]) -> Outcome:
        """An outcome as an earlier run wrote it."""
        category = (record.get("error") or {}).get("category")
        return Outcome(kind="result" if kind == "result" else "dead_letter", key=key,
                       value=raw, task_id=prep.task.task_id, category=category,
                       attempts=int(record.get("attempts", 0)))  # fmt: skip

    def _state_missing(self, prep: Prepared, outcome: Outcome) -> bool:
        state = self.tables.state(prep.task.task_id)
        want = Status.SUCCEEDED if outcome.kind == "result" else Status.DEAD_LETTERED
        return (
            state is None
            or state.status is not want
            or (outcome.kind == "result" and state.result_key != prep.result_key)
        )

    @staticmethod
    def _written(table: Any, key: str, source: Source) -> bool:
        """Did an earlier run of this very record write `key`?"""
        stored = table.get(key.encode())
        return stored is not None and orjson.loads(stored).get("source") == source.model_dump()

    def _state_after(self, outcome: Outcome, prep: Prepared, source: Source) -> TaskState:
        before = self.tables.state(prep.task.task_id) or TaskState(
            task_id=prep.task.task_id, status=Status.RECEIVED, updated_at=""
        )
        result = outcome.kind == "result"
        error = orjson.loads(outcome.value).get("error") if not result else None
        return before.moved(
            Status.SUCCEEDED if result else Status.DEAD_LETTERED,
            note="cached" if result and outcome.attempts == 0 else None,
            attempts=outcome.attempts,
            input_hash=prep.content_key,
            pipeline=prep.pipeline.name,
            prompt_version=prep.version.version,
            result_key=prep.result_key if result else before.result_key,
            result_topic=self.settings.topics.results if result else before.result_topic,
            result_partition=source.partition if result else before.result_partition,
            source=source,
            last_error=error,
        )

    async def _deliver(self, outcome: Outcome, prep: Prepared | None, source: Source) -> None:
        """Write the outcome (and the task's state) through the tables and wait for the
        broker's acks; a failed write is written again, and a worker that cannot write
        stops without acking, so the record runs again after the restart."""
        table = self.tables.results if outcome.kind == "result" else self.tables.dead_letters
        delay = 0.1
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                writes = [table.put(outcome.key.encode(), outcome.value)]
                if prep is not None:
                    writes.append(self.tables.put_state(self._state_after(outcome, prep, source)))
                await asyncio.gather(*writes)
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
                    "write of %s failed (%r); retry %d in %.1fs", outcome.key, exc, attempt, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
