"""The task agent: micro-batches in, one result or dead letter out per record.

Offset safety: the stream runs without automatic acks (`noack_take`). An
event counts as finished once its result or dead letter is acknowledged by
the broker, and finished events are acked to Faust in arrival order per
partition (`InOrderAcks`), so Faust's commit never passes a record still in
flight, however many run concurrently.

Outcomes are written through the task store (`streams.kafka.store`), whose maps are
backed by the results, dead-letter and task-state topics: a record that runs
again (after a crash or a rebalance) finds its answer there and writes
nothing; a new record for an answered task gets the stored answer back
(`cached: true`), and identical inputs of different tasks share one LLM call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, cast

import faust
import orjson
from aiokafka.errors import KafkaError
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace import Status as SpanStatus

from streams.contract.headers import (
    BACKTRACK_HEADER,
    FORCE_HEADER,
    REROUTED_FROM_HEADER,
    TIER_HEADER,
)
from streams.contract.lanes import Lane
from streams.contract.records import Source
from streams.core.batches import BatchLane
from streams.core.dispatch import Dispatcher, LaneSlots
from streams.core.offsets import InOrderAcks, Ticket
from streams.core.processor import Outcome, Prepared, TaskProcessor
from streams.errors import InternalError, WriteRefused
from streams.kafka import faust_private
from streams.kafka.eos import PartitionLost, Transactions
from streams.kafka.limits import WriteLimits, refused_for_good
from streams.kafka.routing import partition_for
from streams.kafka.shutdown import Watchdog
from streams.kafka.store import ContentCache, Kind, MapView, Status, TaskState, TaskStore
from streams.kafka.topics import ledger_topic, state_topic
from streams.llm.openai_client import OpenAIClient
from streams.observability.logs import current_task_id
from streams.observability.metrics import Metrics
from streams.observability.tracing import TRACER, context_from_headers, headers_for
from streams.settings import Settings

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


class CannotWrite(Exception):
    """The broker cannot be written to: the worker is stopping, the record stays unacked."""


class TaskAgent:
    """Owns the agent's topics and the per-worker processor and dispatcher."""

    def __init__(
        self,
        app: faust.App,
        settings: Settings,
        make_processor: Callable[[], TaskProcessor],
        metrics: Metrics | None = None,
        limits: WriteLimits | None = None,
    ) -> None:
        self.app = app
        self.settings = settings
        self.make_processor = make_processor
        self.metrics = metrics or Metrics()
        self.limits = limits or WriteLimits(settings.kafka.max_request_bytes)
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
        self._topics = {topic.get_topic_name(): topic for topic in (
            self.live_topic, self.replay_topic, self.results_topic, self.dead_letter_topic,
            self.state_topic, self.review_topic, self.ledger_topic)}  # fmt: skip
        self.store = TaskStore(
            settings, self._send, self.metrics, state_room=self.limits.room(state_topic(settings))
        )
        # Exactly-once: every write of partition p in p's transaction with its offsets.
        self.eos = (
            Transactions(settings, on_error=self._crash, on_fenced=self._on_fenced)
            if settings.processing_guarantee == "exactly_once"
            else None
        )
        self.cache = ContentCache()
        self.acks: InOrderAcks[Any] = InOrderAcks()
        # A stop takes at most `shutdown_grace_s`; what is unfinished then stays unacked.
        self.watchdog = Watchdog(settings.shutdown_grace_s, self.left_behind)
        self._inputs = {settings.topics.tasks, settings.topics.replay}
        app.on_partitions_assigned.connect(self._on_assigned)  # type: ignore[arg-type]  # faust types receivers as taking only keyword args after the sender
        # faust types the agent function's param as StreamT
        self.live_agent = app.agent(self.live_topic, name="llm-streams.tasks")(self.run_live)  # type: ignore[arg-type]
        replay_agent = app.agent(self.replay_topic, name="llm-streams.ops.replay")
        self.replay_agent = replay_agent(self.run_replay)  # type: ignore[arg-type]
        self.metrics.watch_stream(self.stream_state)

    def left_behind(self) -> str:
        """Records taken and not finished, per partition (for the last log line)."""
        unfinished = self.acks.unfinished()
        if not unfinished:
            return "nothing"
        # Keys are the messages' topic-partition tuples (Faust's or aiokafka's).
        named = sorted((f"{getattr(tp, 'topic', tp)}/{getattr(tp, 'partition', '')}", n)
                       for tp, n in unfinished.items())  # fmt: skip
        parts = ", ".join(f"{where}: {n}" for where, n in named)
        return f"{sum(unfinished.values())} record(s) ({parts})"

    def stream_state(self) -> dict[str, Any]:
        """Lag per partition, partitions paused by backpressure, records buffered."""
        consumer = self.app.consumer
        committed_offsets = faust_private.committed_offsets(consumer)
        lag: dict[tuple[str, int], int] = {}
        for tp in consumer.assignment():
            highwater = consumer.highwater(tp)
            if highwater is None:
                continue
            committed = committed_offsets.get(tp)
            lag[(tp.topic, tp.partition)] = max(0, highwater - (committed or 0))
        return {
            "lag": lag,
            "paused": faust_private.paused_partitions(consumer),
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

    async def _on_fenced(self, partition: int) -> None:
        """Partition's transaction was aborted under this worker. If the group still
        gives the partition to it (no takeover: the transaction timed out), its writes since
        the last commit are gone though their records were acked: drop what the store holds
        of it, and rejoin the group, which assigns the partition again from its committed
        offsets (read back into the store, with a new producer), as Kafka Streams does."""
        inputs = {self.settings.topics.tasks, self.settings.topics.replay}
        try:
            assigned = {tp.partition for tp in self.app.consumer.assignment()
                        if tp.topic in inputs}  # fmt: skip
        except Exception:  # the consumer is not running (stopping): nothing to recover
            return
        if partition not in assigned:
            return  # taken over: the rebalance on its way moves it
        log.warning("partition %d was fenced while still this worker's (its transaction timed "
                    "out?): starting it again from its committed offsets", partition)  # fmt: skip
        self.metrics.partitions_restarted.inc()
        self.store.drop(partition)
        if self.eos is not None:
            await self.eos.forget(partition)
        faust_private.request_rejoin(self.app.consumer)

    async def _send(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        partition: int,
        headers: list[tuple[str, bytes]] | None = None,
        *,
        via: int | None = None,
    ) -> None:
        """One write to `partition` of `topic`, returned once the broker acked it. `via`:
        the task partition whose record caused it, when that is another (exactly-once:
        the write goes into that partition's transaction)."""
        if self.eos is not None:  # into the partition's transaction
            await self.eos.send(topic, key, value, partition, headers, via=via)
            return
        target = self._topics[topic]
        pending = await target.send(key=key, value=value, partition=partition, headers=headers)
        await pending

    async def _send_review(
        self, outcome: Outcome, prep: Prepared, partition: int, headers: list[tuple[str, bytes]]
    ) -> None:
        """The result again, on the review topic, with why a person should look at it."""
        value = orjson.loads(outcome.value)
        value["review"] = {"reasons": list(outcome.review)}
        raw = orjson.dumps(value)
        topic = self.settings.topics.review
        if len(raw) > self.limits.room(topic):  # the result fits its topic; this copy not
            log.warning("review copy of %s left out: %d bytes, over what %s takes",
                        outcome.key, len(raw), topic)  # fmt: skip
            self.metrics.writes_refused.labels(topic, "record_too_large").inc()
            return
        await self._send(topic, outcome.key.encode(), raw, partition, headers)
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
                self._processor.batches = BatchLane(
                    ops, MapView(self.store, Kind.LEDGER), settings.batch_api, self.metrics,
                    ledger_room=self.limits.room(ledger_topic(settings)),
                )  # fmt: skip
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
            # Stopping: in-flight tasks finish and write within the shutdown grace (less a
            # margin to close the clients); the rest are cancelled and stay unacked.
            budget = max(0.0, self.watchdog.remaining(self.settings.shutdown_grace_s) - 3.0)
            try:
                await asyncio.wait_for(asyncio.shield(dispatcher.drain()), timeout=budget)
            except (TimeoutError, asyncio.CancelledError):
                await dispatcher.cancel()
            self._running_lanes -= 1
            if self._running_lanes == 0:  # the last lane out closes what they share
                log.info("task agents stopped; left unacknowledged: %s", self.left_behind())
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
            m = self.metrics
            event = ticket.item
            message = event.message
            # Log lines written for this record carry its task id (the key).
            current_task_id.set(message.key.decode(errors="replace") if message.key else None)
            source = Source(topic=message.topic, partition=message.partition, offset=message.offset)
            lane_name = self.lane_of(message.topic).name.lower()
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
                    kind, outcome = await self._handle(message, source, processor, span)
                except (CannotWrite, asyncio.CancelledError):
                    raise  # unacked: the record runs again after the restart
                except Exception as exc:  # a bug: the record still ends as one dead letter
                    log.exception("internal error on %s/%d/%d", source.topic, source.partition,
                                  source.offset)  # fmt: skip
                    kind, outcome = await self._internal_error(message, source, processor, exc)
                finally:
                    m.in_flight.dec()
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

    async def _handle(
        self, message: Any, source: Source, processor: TaskProcessor, span: Any
    ) -> tuple[str, Outcome | None]:
        """Answer one record and write its outcome: what it ended as (result, dead_letter,
        already_done: an earlier run wrote it, rerouted: forwarded to its task's partition)
        and the outcome written (None when nothing was)."""
        prepared = processor.prepare(message.value, message.key, source)
        if isinstance(prepared, Outcome):  # bad input: a dead letter, unless written
            if self._written(Kind.DEAD_LETTERS, prepared.key, source):
                return "already_done", None
            await self._deliver(prepared, None, source)
            return prepared.kind, prepared
        task_id = prepared.task.task_id
        home = partition_for(task_id, self.settings.kafka.partitions)
        if home != message.partition:  # keyed otherwise by its producer: answer it at home
            await self._reroute(message, source, home, task_id)
            return "rerouted", None
        if message.key != task_id.encode():
            # On its task's partition after all: answered here, where its answers live.
            self.metrics.misrouted.labels(self.lane_of(message.topic).name.lower(),
                                          "answered").inc()  # fmt: skip
        span.set_attributes({
            "llm_streams.pipeline": prepared.pipeline.name,
            "llm_streams.prompt_version": prepared.version.version,
            "llm_streams.result_key": prepared.result_key,
        })  # fmt: skip
        state = self.store.state(source.partition, task_id)
        if state is not None and state.wrote(source):  # this very record, before a crash
            return "already_done", None
        backtrack = header(message, BACKTRACK_HEADER)
        force = header(message, FORCE_HEADER) == b"1" or backtrack == b"rerun"
        asked = header(message, TIER_HEADER)
        tier = asked.decode() if asked in TIERS else None
        lane = self.lane_of(message.topic)
        outcome, written = await self._answer(prepared, processor, lane, force, tier)
        if not written:
            note = BACKTRACK_NOTES.get(backtrack or b"")
            await self._deliver(outcome, prepared, source, note)
            return outcome.kind, outcome
        if self._state_missing(prepared, outcome):
            # Written by a run killed before its state was: write that now.
            try:
                await self.store.put_state(source.partition, self._state_after(outcome, prepared,
                                                                               source))  # fmt: skip
            except PartitionLost as exc:  # the new owner will
                log.info("not writing the state of %s: %s", source, exc)
        return "already_done", None

    async def _reroute(self, message: Any, source: Source, home: int, task_id: str) -> None:
        """Forward a record to the partition its task id maps to, keyed by the task id;
        it is answered there. Counted, and the original position goes in a header."""
        headers = [(k, v) for k, v in (message.headers or ()) if k != REROUTED_FROM_HEADER]
        origin = f"{source.topic}/{source.partition}/{source.offset}".encode()
        headers.append((REROUTED_FROM_HEADER, origin))
        log.info("record %s/%d/%d of task %r belongs to partition %d: forwarded there",
                 source.topic, source.partition, source.offset, task_id, home)  # fmt: skip

        def forward() -> Awaitable[None]:
            return self._send(message.topic, task_id.encode(), message.value, home, headers,
                              via=source.partition)  # fmt: skip

        await self._write_or_stop(forward, what=f"the forward of {origin.decode()}")
        self.metrics.misrouted.labels(self.lane_of(message.topic).name.lower(),
                                      "rerouted").inc()  # fmt: skip

    async def _internal_error(
        self, message: Any, source: Source, processor: TaskProcessor, exc: Exception
    ) -> tuple[str, Outcome | None]:
        """A bug met this record: it ends as a dead letter `internal_error` (not retried,
        not redriven as a provider fault), written once."""
        error = InternalError(f"internal error: {exc!r}", code="internal_error")
        outcome = processor.dead_letter(error, message.value, message.key, source)
        if self._written(Kind.DEAD_LETTERS, outcome.key, source):
            return "already_done", None
        await self._deliver(outcome, None, source)
        return outcome.kind, outcome

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
        """Write the outcome, then the task's state and a review copy, through the store,
        waiting for the broker's acks. The outcome goes first: a state that says this
        record wrote its outcome (`TaskState.wrote`) is then never ahead of the outcome,
        even after a kill between the two. A write the broker may take later is written
        again (only the writes that failed); one it refuses for good (too large, invalid,
        not authorised) makes the task a `write_refused` dead letter, or is left out when
        it is only the review copy. A worker that cannot write stops without acking
        (`CannotWrite`), so the record runs again after the restart."""
        pending = {"outcome", "state", "review"} if prep is not None else {"outcome"}
        if not outcome.review:
            pending.discard("review")
        delay = 0.1
        failures = 0
        while pending:
            # The trace goes on in the outcome's headers (the task's span is current).
            trace_headers = headers_for()
            names = ["outcome"] if "outcome" in pending else sorted(pending)
            writes = [self._write(name, outcome, prep, source, note, trace_headers)
                      for name in names]  # fmt: skip
            failed: BaseException | None = None
            became: Outcome | None = None  # a result the results topic refused for good
            for name, done in zip(names, await asyncio.gather(*writes, return_exceptions=True),
                                  strict=True):  # fmt: skip
                if done is None:
                    pending.discard(name)
                    continue
                if isinstance(done, PartitionLost):  # its new owner answers the record
                    log.info("not writing %s %s: %s", outcome.kind, outcome.key, done)
                    return
                if not isinstance(done, Exception):
                    raise done  # cancelled: unacked, the record runs again
                refused = refused_for_good(done)
                topic = self._topic_of(name, outcome)
                if refused is None:
                    failed = done
                    continue
                self.metrics.writes_refused.labels(topic, refused).inc()
                log.warning("%s refused the %s of %s for good: %r", topic, name, outcome.key, done)
                if name == "review":  # a copy: the result itself is written
                    pending.discard(name)
                elif name == "outcome" and prep is not None and outcome.kind == "result":
                    became = self._processor_failed(prep, outcome, refused, done)
                else:  # a dead letter or a task state the broker will not take: misconfigured
                    await self._stop(f"{topic} refuses the {name} of {outcome.key}", done)
            if became is not None:  # write the dead letter, and the state that says so
                outcome = became
                pending = {"outcome", "state"}
                continue
            if failed is None:
                continue  # these are written: the next ones
            failures += 1
            if failures == SEND_ATTEMPTS:
                await self._stop(f"cannot write {outcome.kind} {outcome.key}", failed)
            log.warning("write of %s failed (%r); retry %d in %.1fs", outcome.key, failed,
                        failures, delay)  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _write(
        self,
        name: str,
        outcome: Outcome,
        prep: Prepared | None,
        source: Source,
        note: str | None,
        headers: list[tuple[str, bytes]],
    ) -> None:
        p = source.partition
        if name == "outcome":
            kind = Kind.RESULTS if outcome.kind == "result" else Kind.DEAD_LETTERS
            await self.store.put(kind, p, outcome.key.encode(), outcome.value, headers)
        elif name == "state" and prep is not None:
            await self.store.put_state(p, self._state_after(outcome, prep, source, note))
        elif name == "review" and prep is not None:
            await self._send_review(outcome, prep, p, headers)

    def _topic_of(self, name: str, outcome: Outcome) -> str:
        t = self.settings.topics
        if name == "state":
            return state_topic(self.settings)
        if name == "review":
            return t.review
        return t.results if outcome.kind == "result" else t.dead_letters

    def _processor_failed(
        self, prep: Prepared, outcome: Outcome, refused: str, exc: BaseException
    ) -> Outcome:
        processor = self._processor
        if processor is None:  # pragma: no cover - a job always runs with one
            raise RuntimeError("no processor")
        error = WriteRefused(
            f"the results topic refused the task's result ({refused}): {exc!r}", code=refused
        )
        return processor.failed(prep, error, outcome)

    async def _write_or_stop(self, write: Callable[[], Awaitable[None]], what: str) -> None:
        """One write, again while the broker may take it later; stop when it will not."""
        delay = 0.1
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                await write()
                return
            except PartitionLost as exc:
                log.info("not writing %s: %s", what, exc)
                return
            except KafkaError as exc:
                if refused_for_good(exc) is not None or attempt == SEND_ATTEMPTS:
                    await self._stop(f"cannot write {what}", exc)
                log.warning("write of %s failed (%r); retry %d in %.1fs", what, exc, attempt,
                            delay)  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _stop(self, why: str, exc: BaseException | None) -> NoReturn:
        """The broker cannot be written to: stop the worker without acking the record."""
        log.critical("%s: %r; stopping the worker", why, exc)
        error = CannotWrite(why)
        await self._crash(exc or error)
        raise error from exc

    async def _crash(self, exc: BaseException) -> None:
        """Stop the worker because of `exc`, within the shutdown grace."""
        self.watchdog.start(f"crash: {exc!r}")
        await self.app.crash(exc)
