"""The task agent: micro-batches in, one result or dead letter out per record.

Offset safety: the stream runs without automatic acks (`noack_take`). An
event counts as finished once its result or dead letter is acknowledged by
the broker, and finished events are acked to Faust in arrival order per
partition (`InOrderAcks`), so Faust's commit never passes a record still in
flight, however many run concurrently.

Outcomes are written through the task store (`streams.state`), whose maps are
backed by the results, dead-letter and task-state topics: a record that runs
again (after a crash or a rebalance) finds its answer there and writes
nothing; a new record for an answered task gets the stored answer back
(`cached: true`), and identical inputs of different tasks share one LLM call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import faust
import orjson
from aiokafka.errors import KafkaError
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace import Status as SpanStatus

from streams.backtrack import BACKTRACK_HEADER
from streams.eos import PartitionLost, Transactions
from streams.llm.openai_client import OpenAIClient
from streams.logs import current_task_id
from streams.metrics import Metrics
from streams.processing.batches import BatchLane
from streams.processing.dispatch import Dispatcher, LaneSlots
from streams.processing.offsets import InOrderAcks, Ticket
from streams.processing.processor import Outcome, Prepared, TaskProcessor
from streams.records import Source
from streams.replay import FORCE_HEADER, TIER_HEADER
from streams.resilience.limiter import Lane
from streams.settings import Settings
from streams.state import ContentCache, Kind, Status, TaskState, TaskStore
from streams.topics import ledger_topic, state_topic
from streams.tracing import TRACER, context_from_headers, headers_for

log = logging.getLogger(__name__)

SEND_ATTEMPTS = 8
BACKTRACK_NOTES = {b"restore": "backtrack: restored", b"rerun": "backtrack: re-run"}
TIERS = (b"sync", b"flex", b"batch")


def header(message: Any, name: str) -> bytes | None:
    """A record header's value (the last one of that name), or None."""
    headers = message.headers or ()
    items = headers.items() if isinstance(headers, dict) else headers
    found = None
    for key, value in items:
        if key == name:
            found = value
    return found


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
        self._streams: dict[Lane, faust.Stream[Any]] = {}
        # internal=True: Faust creates missing topics with the configured partitions.
        raw: dict[str, Any] = {"key_serializer": "raw", "value_serializer": "raw", "internal": True}
        # One agent per lane, each with its own stream buffer, so a live record never
        # waits behind replay records; they share the concurrency slots (live first, replay
        # never the live reserve) and the rate limiter (which serves live first).
        self.live_topic = app.topic(settings.topics.tasks, **raw)
        self.replay_topic = app.topic(settings.topics.replay, **raw)
        batch = settings.batch
        reserve = min(batch.concurrency - 1, round(batch.concurrency * batch.live_reserve))
        self.slots = LaneSlots(batch.concurrency, reserve)
        self._processor: TaskProcessor | None = None
        self._running_lanes = 0
        parts: dict[str, Any] = {**raw, "partitions": settings.kafka.partitions}
        self.results_topic = app.topic(settings.topics.results, compacting=True, **parts)
        self.dead_letter_topic = app.topic(settings.topics.dead_letters, **parts)
        self.state_topic = app.topic(state_topic(settings), compacting=True, **parts)
        self.review_topic = app.topic(settings.topics.review, **parts)
        self.ledger_topic = app.topic(ledger_topic(settings), compacting=True, **parts)
        self.store = TaskStore(settings, self._send, self.metrics)
        # Exactly-once: every write of partition p in p's transaction with its offsets.
        self.eos = (
            Transactions(settings, on_error=app.crash)
            if settings.processing_guarantee == "exactly_once"
            else None
        )
        self.cache = ContentCache()
        self.acks: InOrderAcks[Any] = InOrderAcks()
        self._inputs = {settings.topics.tasks, settings.topics.replay}
        app.on_partitions_assigned.connect(self._on_assigned)  # type: ignore[arg-type]  # faust types receivers as taking only keyword args after the sender
        # faust types the agent function's param as StreamT
        self.live_agent = app.agent(self.live_topic, name="llm-streams.tasks")(self.run_live)  # type: ignore[arg-type]
        replay_agent = app.agent(self.replay_topic, name="llm-streams.replay")
        self.replay_agent = replay_agent(self.run_replay)  # type: ignore[arg-type]
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
        return {
            "lag": lag,
            "paused": len(getattr(consumer, "_buffered_partitions", ())),
            "buffered": sum(
                cast(Any, stream.channel).queue.qsize() for stream in self._streams.values()
            ),
        }

    async def _on_assigned(self, sender: Any, assigned: set[Any], **kwargs: Any) -> None:
        """Faust's rebalance signal: own the store partitions of the task partitions."""
        partitions = {tp.partition for tp in assigned if tp.topic in self._inputs}
        if self.eos is not None:
            self.eos.hook_consumer(self.app.consumer)
            await self.eos.assign(partitions)
        self.store.assign(partitions)

    async def _send(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        partition: int,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """One write to `partition` of `topic`, returned once the broker acked it."""
        if self.eos is not None:  # into the partition's transaction
            await self.eos.send(topic, key, value, partition, headers)
            return
        target = {
            self.results_topic.get_topic_name(): self.results_topic,
            self.dead_letter_topic.get_topic_name(): self.dead_letter_topic,
            self.state_topic.get_topic_name(): self.state_topic,
            self.review_topic.get_topic_name(): self.review_topic,
            self.ledger_topic.get_topic_name(): self.ledger_topic,
        }[topic]
        pending = await target.send(key=key, value=value, partition=partition, headers=headers)
        await pending

    async def _send_review(
        self, outcome: Outcome, prep: Prepared, partition: int, headers: list[tuple[str, bytes]]
    ) -> None:
        """The result again, on the review topic, with why a person should look at it."""
        value = orjson.loads(outcome.value)
        value["review"] = {"reasons": list(outcome.review)}
        await self._send(self.settings.topics.review, outcome.key.encode(), orjson.dumps(value),
                         partition, headers)  # fmt: skip
        for reason in outcome.review:
            self.metrics.reviews.labels(prep.pipeline.name, reason).inc()

    def lane_of(self, topic: str) -> Lane:
        return Lane.REPLAY if topic == self.settings.topics.replay else Lane.LIVE

    async def run_live(self, stream: faust.Stream[Any]) -> None:
        await self._run(stream, Lane.LIVE)

    async def run_replay(self, stream: faust.Stream[Any]) -> None:
        await self._run(stream, Lane.REPLAY)

    async def _run(self, stream: faust.Stream[Any], lane: Lane) -> None:
        settings = self.settings
        if self._processor is None:  # one for both lanes: one limiter, one breaker
            self._processor = self.make_processor()
            ops = self._processor.client.client
            if isinstance(ops, OpenAIClient):  # the provider's Batch API, for the batch tier
                self._processor.batches = BatchLane(ops, self.store, settings.batch_api,
                                                    self.metrics)  # fmt: skip
        processor = self._processor
        self._running_lanes += 1
        dispatcher = Dispatcher(slots=self.slots, lane=lane)
        self._streams[lane] = stream
        lane_name = lane.name.lower()
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
                    m.tasks_received.labels(lane_name).inc()
                    if message.timestamp:
                        m.taken_after.labels(lane_name).observe(
                            max(0.0, time.time() - message.timestamp)
                        )
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
            self._running_lanes -= 1
            if self._running_lanes == 0:  # the last lane out closes what they share
                self._processor = None
                await processor.close()
                await self.store.close()
                if self.eos is not None:
                    await self.eos.close()

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
                # store or the broker. The record stays unacked, and a worker that kept
                # going would stall its partition's commits; stop and run it again.
                log.critical("job for %s failed: %r; stopping the worker", ticket.item, exc)
                await self.app.crash(exc)
                raise

        async def run() -> None:
            m = self.metrics
            event = ticket.item
            message = event.message
            # Log lines written for this record carry its task id (the key).
            current_task_id.set(message.key.decode(errors="replace") if message.key else None)
            source = Source(topic=message.topic, partition=message.partition, offset=message.offset)
            lane = self.lane_of(message.topic)
            lane_name = lane.name.lower()
            # A span per record, continuing the producer's trace (W3C traceparent header).
            with TRACER.start_as_current_span(
                f"process {message.topic}",
                context=context_from_headers(message.headers),
                kind=SpanKind.CONSUMER,
                attributes={
                    "messaging.system": "kafka",
                    "messaging.operation.type": "process",
                    "messaging.destination.name": message.topic,
                    "messaging.destination.partition.id": str(message.partition),
                    "messaging.kafka.offset": message.offset,
                    "llm_streams.task_id": message.key.decode(errors="replace")
                    if message.key
                    else "",
                    "llm_streams.lane": lane_name,
                },
            ) as span:
                m.queue_wait.labels(lane_name).observe(time.monotonic() - taken_at)
                m.in_flight.inc()
                try:
                    await self.store.ready(message.partition)  # its answers loaded
                    prepared = processor.prepare(message.value, message.key, source)
                    if isinstance(prepared, Outcome):  # bad input: a dead letter, unless written
                        outcome: Outcome | None = prepared
                        if self._written(Kind.DEAD_LETTERS, prepared.key, source):
                            outcome = None
                        else:
                            await self._deliver(prepared, None, source)
                    else:
                        span.set_attributes({
                            "llm_streams.pipeline": prepared.pipeline.name,
                            "llm_streams.prompt_version": prepared.version.version,
                            "llm_streams.result_key": prepared.result_key,
                        })  # fmt: skip
                        backtrack = header(message, BACKTRACK_HEADER)
                        force = header(message, FORCE_HEADER) == b"1" or backtrack == b"rerun"
                        asked = header(message, TIER_HEADER)
                        tier = asked.decode() if asked in TIERS else None
                        outcome, written = await self._answer(
                            prepared, processor, lane, force, tier
                        )
                        if not written:
                            note = BACKTRACK_NOTES.get(backtrack or b"")
                            await self._deliver(outcome, prepared, source, note)
                        elif self._state_missing(prepared, outcome):
                            # Written by a run killed before its state was: write that now.
                            state = self._state_after(outcome, prepared, source)
                            try:
                                await self.store.put_state(source.partition, state)
                            except PartitionLost as exc:  # the new owner will
                                log.info("not writing the state of %s: %s", source, exc)
                        if written:
                            outcome = None
                finally:
                    m.in_flight.dec()
                kind = outcome.kind if outcome is not None else "already_done"
                span.set_attribute("llm_streams.outcome", kind)
                if outcome is not None and outcome.category is not None:
                    span.set_attribute("error.type", outcome.category)
                    span.set_status(SpanStatus(StatusCode.ERROR, outcome.category))
                m.tasks_completed.labels(lane_name, kind).inc()
                if outcome is not None and outcome.category is not None:
                    m.dead_letters.labels(outcome.category).inc()
                    error = orjson.loads(outcome.value).get("error") or {}
                    log.info(
                        "dead letter %s/%s after %d attempt(s) for %s/%d/%d: %s",
                        error.get("category"), error.get("code"), outcome.attempts,
                        source.topic, source.partition, source.offset, error.get("message"),
                    )  # fmt: skip
                if message.timestamp:  # seconds since the epoch, set by the producer or broker
                    m.end_to_end.labels(lane_name, kind).observe(
                        max(0.0, time.time() - message.timestamp)
                    )
                for done in self.acks.finished(ticket):
                    await stream.ack(done)
                    m.unfinished.dec()

        return job

    async def _answer(
        self,
        prep: Prepared,
        processor: TaskProcessor,
        lane: Lane,
        force: bool = False,
        tier: str | None = None,
    ) -> tuple[Outcome, bool]:
        """The outcome of a valid task, and whether an earlier run of this very record
        (before a crash or rebalance) already wrote it. `force` (a forced replay) asks
        the LLM again even when the task or an identical input was answered."""
        store, p = self.store, prep.source.partition
        stored = store.get(Kind.RESULTS, p, prep.result_key.encode())
        if stored is not None:
            earlier = orjson.loads(stored)
            if earlier.get("source") == prep.source.model_dump():
                return self._stored(prep, "result", prep.result_key, stored, earlier), True
            if not force:  # answered before for another record of the task: no call
                self.metrics.cache_hits.labels(prep.pipeline.name, "result").inc()
                return processor.from_cache(prep, earlier["output"], earlier["model"]), False
        dead = store.get(Kind.DEAD_LETTERS, p, prep.task.task_id.encode())
        if dead is not None:
            letter = orjson.loads(dead)
            if letter.get("source") == prep.source.model_dump():
                return self._stored(prep, "dead_letter", prep.task.task_id, dead, letter), True

        earlier = self._earlier_stages(prep)

        async def call() -> tuple[Outcome, tuple[dict[str, Any], str] | None]:
            outcome = await processor.answer(prep, lane, earlier, tier)
            if outcome.kind == "result" and outcome.output is not None and outcome.model:
                return outcome, (outcome.output, outcome.model)
            return outcome, None

        if force:
            outcome, answer = await call()
            if answer is not None:
                self.cache.put(prep.content_key, *answer)
            return outcome, False
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

    def _earlier_stages(self, prep: Prepared) -> dict[str, Any] | None:
        """Answers of the stages an earlier run of this task got before a later stage
        failed, when they are for the same input and version."""
        if not prep.pipeline.stages:
            return None
        state = self.store.state(prep.source.partition, prep.task.task_id)
        if (
            state is None
            or not state.stage_outputs
            or state.input_hash != prep.content_key
            or state.prompt_version != prep.version.version
        ):
            return None
        return state.stage_outputs

    def _state_missing(self, prep: Prepared, outcome: Outcome) -> bool:
        state = self.store.state(prep.source.partition, prep.task.task_id)
        want = Status.SUCCEEDED if outcome.kind == "result" else Status.DEAD_LETTERED
        return (
            state is None
            or state.status is not want
            or (outcome.kind == "result" and state.result_key != prep.result_key)
        )

    def _written(self, kind: Kind, key: str, source: Source) -> bool:
        """Did an earlier run of this very record write `key`?"""
        stored = self.store.get(kind, source.partition, key.encode())
        return stored is not None and orjson.loads(stored).get("source") == source.model_dump()

    def _state_after(
        self, outcome: Outcome, prep: Prepared, source: Source, note: str | None = None
    ) -> TaskState:
        before = self.store.state(source.partition, prep.task.task_id) or TaskState(
            task_id=prep.task.task_id, status=Status.RECEIVED, updated_at=""
        )
        result = outcome.kind == "result"
        error = orjson.loads(outcome.value).get("error") if not result else None
        return before.moved(
            Status.SUCCEEDED if result else Status.DEAD_LETTERED,
            note=note or ("cached" if result and outcome.attempts == 0 else None),
            attempts=outcome.attempts,
            input_hash=prep.content_key,
            pipeline=prep.pipeline.name,
            prompt_version=prep.version.version,
            result_key=prep.result_key if result else before.result_key,
            result_topic=self.settings.topics.results if result else before.result_topic,
            result_partition=source.partition if result else before.result_partition,
            source=source,
            last_error=error,
            stage=outcome.stage,
            stage_outputs=None if result else outcome.stages,
        )

    async def _deliver(
        self, outcome: Outcome, prep: Prepared | None, source: Source, note: str | None = None
    ) -> None:
        """Write the outcome (and the task's state) through the store and wait for the
        broker's acks; a failed write is written again, and a worker that cannot write
        stops without acking, so the record runs again after the restart."""
        kind = Kind.RESULTS if outcome.kind == "result" else Kind.DEAD_LETTERS
        p = source.partition
        delay = 0.1
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                # The trace goes on in the outcome's headers (the task's span is current).
                trace_headers = headers_for()
                writes = [
                    self.store.put(kind, p, outcome.key.encode(), outcome.value, trace_headers)
                ]
                if prep is not None:
                    state = self._state_after(outcome, prep, source, note)
                    writes.append(self.store.put_state(p, state))
                if outcome.review and prep is not None:
                    writes.append(self._send_review(outcome, prep, p, trace_headers))
                await asyncio.gather(*writes)
                return
            except PartitionLost as exc:  # its new owner answers the record
                log.info("not writing %s %s: %s", outcome.kind, outcome.key, exc)
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
