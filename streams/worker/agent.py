"""The task agent: the thin Faust edge. Micro-batches in; per record the headers are
read, the core decides (`core.decide`) and answers (`core.processor`), the writer
writes (`worker.writer`), and the record is acked.

Offset safety: the stream runs without automatic acks (`worker.take`). An
event counts as finished once its result or dead letter is acknowledged by
the broker, and finished events are acked to Faust in arrival order per
partition (`InOrderAcks`), so Faust's commit never passes a record still in
flight, however many run concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import faust

from streams.contract.lanes import Lane
from streams.core.batch import BatchLane
from streams.core.cache import ContentCache
from streams.core.decide import Decider, Ended
from streams.core.dispatch import Dispatcher, LaneSlots
from streams.core.drift import DriftMonitor
from streams.core.offsets import InOrderAcks, Ticket
from streams.core.processor import TaskProcessor
from streams.kafka.limits import WriteLimits
from streams.kafka.topics import ledger_topic, sessions_topic, state_topic
from streams.llm.openai_client import OpenAIClient
from streams.observability.health import Readiness, open_breakers
from streams.observability.metrics import Metrics
from streams.pipelines.sources import SourceMapper
from streams.resilience.limiter import GroupShare
from streams.settings import Settings
from streams.store.taskstore import Kind, MapView, TaskStore
from streams.worker import faust_private
from streams.worker.eos import Transactions
from streams.worker.flow import RecordFlow
from streams.worker.idle_replay import IdleReplay
from streams.worker.parked import Resumer, StoredRecord
from streams.worker.shutdown import Watchdog
from streams.worker.sources import SourceIngest
from streams.worker.take import take
from streams.worker.writer import CannotWrite, Headers, Writer

log = logging.getLogger(__name__)


class TaskAgent:
    """Owns the agent's topics and the per-worker processor and dispatcher."""

    def __init__(
        self,
        app: faust.App,
        settings: Settings,
        make_processor: Callable[[], TaskProcessor],
        metrics: Metrics | None = None,
        limits: WriteLimits | None = None,
        sources: dict[str, list[SourceMapper]] | None = None,
        group: GroupShare | None = None,
        drift: DriftMonitor | None = None,
    ) -> None:
        self.app = app
        self.group = group or GroupShare()
        self.drift = drift  # fed every fresh answer (output drift per version)
        self.settings = settings
        self.make_processor = make_processor
        self.metrics = metrics or Metrics()
        self.limits = limits or WriteLimits(settings.kafka.max_request_bytes)
        self._streams: dict[Lane, faust.Stream[Any]] = {}
        self.slots = LaneSlots.sharing(settings.batch.concurrency, settings.batch.live_reserve)
        self._processor: TaskProcessor | None = None
        self._running_lanes = 0
        # The written topics are the producer's alone (`_topic_send`): no Faust topics.
        # A stop takes at most `shutdown_grace_s`; what is unfinished then stays unacked.
        self.watchdog = Watchdog(settings.shutdown_grace_s, self.left_behind)
        self.watchdog.on_start.append(self.begin_stop)
        self.stopping = False
        self._dispatchers: dict[Lane, Dispatcher] = {}
        self._finishing: asyncio.Future[None] | None = None
        self._left_at_stop = 0  # records taken and, the stop begun, not started
        state_bytes = self.limits.value_bytes(state_topic(settings))
        self.store = TaskStore(settings, self._send, self.metrics, state_bytes=state_bytes)
        self.store.on_damaged = self._on_damaged
        # Exactly-once: every write of partition p in p's transaction with its offsets.
        self.eos: Transactions | None = None
        if settings.processing_guarantee == "exactly_once":
            self.eos = Transactions(
                settings, on_error=self._crash, on_fenced=self._on_fenced,
                on_committed=self.store.committed,
            )  # fmt: skip
        self.writer = Writer(
            settings, send=self._topic_send, store=self.store, eos=self.eos, limits=self.limits,
            metrics=self.metrics, watchdog=self.watchdog, crash=app.crash,
        )  # fmt: skip
        self.cache = ContentCache()
        self.acks: InOrderAcks[Any] = InOrderAcks()
        self._flow: RecordFlow | None = None  # a record's way (worker.flow), made with them
        self._inputs = {settings.topics.tasks, settings.topics.replay}
        self._joined = False  # a rebalance has given the worker its partitions (`readiness`)
        # Records parked in the batch lane's ledger, run again when their batch ends.
        self.parked = Resumer(self.store, self.slots, self._run_parked)
        # Existing topics read as they are (pipelines' `source:`): mapped, forwarded.
        self.sources: SourceIngest | None = None
        if sources:
            self.sources = SourceIngest(settings, sources, self.writer, self.limits, self.metrics)
        self._wire(app)
        self.metrics.watch_stream(self.stream_state)

    def _wire(self, app: faust.App) -> None:
        """The Faust side: its topics, one agent per lane (and one for the sources), the
        rebalance receiver."""
        # Not internal: the worker makes its topics before Faust starts (`ensure_topics`,
        # co-partitioned, only when missing), so Faust never asks to create one — a
        # principal without CREATE (topics made ahead of time) runs as well.
        raw: dict[str, Any] = {"key_serializer": "raw", "value_serializer": "raw"}
        # One agent per lane, each with its own stream buffer, so a live record never
        # waits behind replay records; they share the concurrency slots (live first, replay
        # never the live reserve) and the rate limiter (which serves live first).
        self.live_topic = app.topic(self.settings.topics.tasks, **raw)
        self.replay_topic = app.topic(self.settings.topics.replay, **raw)
        app.on_partitions_assigned.connect(self._on_assigned)  # type: ignore[arg-type]  # faust types receivers as taking only keyword args after the sender
        # faust types the agent function's param as StreamT
        self.live_agent = app.agent(self.live_topic, name="llm-streams.tasks")(self.run_live)  # type: ignore[arg-type]
        replay_agent = app.agent(self.replay_topic, name="llm-streams.replay")
        self.replay_agent = replay_agent(self.run_replay)  # type: ignore[arg-type]
        if self.sources is not None:
            source_topic = app.topic(*self.sources.topics, **raw)
            source_agent = app.agent(source_topic, name="llm-streams.sources")
            self.source_agent = source_agent(self.run_sources)  # type: ignore[arg-type]

    def readiness(self) -> Readiness:
        """What `/readyz` says (observability.health)."""
        owned = sorted(self.store.owned())
        return Readiness(
            joined=self._joined, partitions=tuple(owned),
            loading=tuple(p for p in owned if not self.store.loaded(p)),
            open_breakers=open_breakers(self.metrics),
            standby=tuple(sorted(self.store.standing_by())),
            disk_refusing=self.store.disk_refusing(),
        )  # fmt: skip

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
        return faust_private.stream_state(self.app.consumer, self._streams.values())

    async def _on_assigned(self, sender: Any, assigned: set[Any], **kwargs: Any) -> None:
        """Faust's rebalance signal: own the store partitions of the task partitions."""
        n = self.settings.kafka.partitions
        partitions = {tp.partition for tp in assigned if tp.topic in self._inputs}
        # Partitions past the store's (added to the task topics later) hold no task's
        # home: their records are forwarded home (worker.flow), nothing of theirs is stored.
        homes = {p for p in partitions if p < n}
        self.store.arriving(homes)  # their records may come before the store is told
        # Records of a partition given away, or new to the store (dropped after a fence),
        # are not acked by their earlier runs: they run again from the committed offset.
        fresh = homes - self.store.owned()
        self._forget({tp for tp in self.acks.partitions()
                      if getattr(tp, "partition", None) not in partitions - fresh})  # fmt: skip
        # The limiters claim this worker's part of the group's work (see GroupShare).
        consumer = self.app.consumer
        total = sum(min(consumer.topic_partitions(t) or n, n) for t in self._inputs)
        mine = sum(1 for tp in assigned if tp.topic in self._inputs and tp.partition < n)
        self.group.assigned(mine, total)
        if self.eos is not None:  # every partition: a forward goes in its record's transaction
            self.eos.hook_consumer(self.app.consumer)
            await self.eos.assign(partitions)
        self.store.assign(homes)
        # Standbys (store_standby_replicas): the assignor's, over the same task partitions
        # (it places one even at 0: see worker.app).
        standbys = {tp.partition for tp in self.app.assignor.assigned_standbys()
                    if tp.topic in self._inputs and tp.partition < n}  # fmt: skip
        self.store.standby(standbys - homes if self.settings.store_standby_replicas else set())
        self.parked.assigned(homes)
        if self._processor is not None:  # tasks at a spend cap: their share, their partition
            self._processor.budgets.changed()
        self._joined = True

    async def _on_fenced(self, partition: int) -> None:
        """Partition's transaction was aborted under this worker. If the group still
        gives the partition to it (no takeover: the transaction timed out), its writes since
        the last commit are gone though their records were acked: drop what the store holds
        of it, and rejoin the group, which assigns the partition again from its committed
        offsets (read back into the store, with a new producer), as Kafka Streams does."""
        await self._start_again(partition, "was fenced while still this worker's (its "
                                "transaction timed out?)")  # fmt: skip

    async def _on_damaged(self, partition: int) -> None:
        """Partition's local store was found damaged and deleted (`TaskStore._damaged`): the
        records taken from it are left unacked, and the partition starts again the same
        way, its topics read into a new copy."""
        await self._start_again(partition, "lost its local store (damaged)")

    async def _start_again(self, partition: int, why: str) -> None:
        inputs = {self.settings.topics.tasks, self.settings.topics.replay}
        try:
            assigned = {tp.partition for tp in self.app.consumer.assignment()
                        if tp.topic in inputs}  # fmt: skip
        except Exception:  # the consumer is not running (stopping): nothing to recover
            return
        if partition not in assigned:
            return  # taken over: the rebalance on its way moves it
        log.warning("partition %d %s: starting it again from its committed offsets",
                    partition, why)  # fmt: skip
        self.metrics.partitions_restarted.inc()
        self.store.drop(partition)
        self._forget({tp for tp in self.acks.partitions()
                      if getattr(tp, "partition", None) == partition})  # fmt: skip
        if self.eos is not None:
            await self.eos.forget(partition)
        faust_private.request_rejoin(self.app.consumer)

    def _forget(self, tps: set[Any]) -> None:
        """The records taken from `tps` are acked by none of their runs (see
        `core.offsets.InOrderAcks.forget`), nor waited for by Faust's rebalance."""
        for tp in tps:
            events = self.acks.forget(tp)
            if events:
                self.metrics.unfinished.dec(len(events))
                with contextlib.suppress(Exception):  # no consumer (stopping): nothing waits
                    faust_private.forget_unacked(self.app.consumer,
                                                 [e.message for e in events])  # fmt: skip
                log.info("%s: %d record(s) taken are left to run again from the committed "
                         "offset", tp, len(events))  # fmt: skip

    async def _send(
        self,
        topic: str,
        key: bytes,
        value: bytes | None,
        partition: int,
        headers: Headers | None = None,
        *,
        via: int | None = None,
    ) -> int:
        """The store's write function: through the writer (and exactly-once)."""
        return await self.writer.send(topic, key, value, partition, headers, via=via)

    async def _topic_send(
        self, topic: str, key: bytes, value: bytes | None, partition: int, headers: Headers | None
    ) -> int:
        return await faust_private.send(self.app, topic, key, value, partition, headers)

    async def _crash(self, exc: BaseException) -> None:
        await self.writer.crash(exc)

    def lane_of(self, topic: str) -> Lane:
        return Lane.REPLAY if topic == self.settings.topics.replay else Lane.LIVE

    async def run_live(self, stream: faust.Stream[Any]) -> None:
        await self._run(stream, Lane.LIVE)

    async def run_replay(self, stream: faust.Stream[Any]) -> None:
        every_s = self.settings.kafka.replay_idle_check_s
        idle = None
        # The lane's partitions out of the fetches while they hold nothing (the consumer on
        # the worker's loop only: on a thread, aiokafka is not this loop's to pause).
        if every_s > 0 and not self.settings.kafka.consumer_thread:
            check = IdleReplay(lambda: self.app.consumer, self.settings.topics.replay, every_s,
                               self.metrics.replay_idle)  # fmt: skip
            idle = asyncio.create_task(check.run())
        try:
            await self._run(stream, Lane.REPLAY)
        finally:
            if idle is not None:
                idle.cancel()
                await asyncio.gather(idle, return_exceptions=True)

    def _processor_now(self) -> TaskProcessor:
        """The worker's processor, made by the first agent that runs: one for every lane
        (one limiter, one breaker per endpoint)."""
        settings = self.settings
        if self._processor is None:
            self._processor = self.make_processor()
            # Tasks in flight follow what the endpoint takes at once (backpressure: the
            # rest wait in Kafka, their deadlines not yet running).
            # From the endpoint's first word on: until then, nothing is known to hold.
            self._processor.client.concurrency.on_change = self._follow_endpoint
            self._processor.owns = lambda partition: partition in self.store.owned()
            self._processor.budgets.owned = self.store.owned  # the spend of its partitions
            ops = self._processor.client.client
            if isinstance(ops, OpenAIClient):  # the provider's Batch API, for the batch tier
                durable = self.eos.durable if self.eos is not None else None
                ledger = MapView(self.store, Kind.LEDGER, durable=durable)
                lane_ = self._processor.batches = BatchLane(
                    ops, ledger, settings.batch_api, self.metrics,
                    ledger_bytes=self.limits.value_bytes(ledger_topic(settings)),
                )  # fmt: skip
                self.parked.attach(lane_)
            decider = Decider(self._processor, self.store, self.cache, self.metrics,
                              settings.topics.results)  # fmt: skip
            self._flow = RecordFlow(
                self._processor, decider, self.store, self.writer,
                partitions=settings.kafka.partitions,
                sessions_bytes=self.limits.value_bytes(sessions_topic(settings)),
                lane_of=self.lane_of, metrics=self.metrics, drift=self.drift,
            )  # fmt: skip
        self._running_lanes += 1
        return self._processor

    def _follow_endpoint(self, limit: int | None) -> None:
        """The primary endpoint takes `limit` calls at once (None: no limit there): hold
        the tasks in flight to twice that and two more, so that the next calls are ready
        to go when one ends and no task waits long for its turn."""
        self.slots.cap(None if limit is None else 2 * limit + 2)

    async def _lane_stopped(self, processor: TaskProcessor) -> None:
        self._running_lanes -= 1
        if self._running_lanes == 0:  # the last agent out closes what they share
            log.info("task agents stopped; left unacknowledged: %s", self.left_behind())
            await self.parked.close()  # what is parked stays in the ledger
            self._processor = self._flow = None
            await processor.close()
            if self.eos is not None:  # its last commit goes to the store's disk too
                await self.eos.close()
            await self.store.close()

    async def run_sources(self, stream: faust.Stream[Any]) -> None:
        """Records of the source topics: mapped and forwarded as tasks (worker.sources)."""
        assert self.sources is not None
        processor = self._processor_now()
        try:
            async for events in take(
                stream, self.settings.batch.size, within=self.settings.batch.window_s
            ):
                await self._forward(stream, events, processor)
        finally:
            await self.sources.close()
            await self._lane_stopped(processor)

    async def _forward(self, stream: Any, events: list[Any], processor: TaskProcessor) -> None:
        """Source records mapped, forwarded and acked; once a stop has begun, left unacked
        instead, as the lanes leave theirs: the partition's next owner forwards them."""
        assert self.sources is not None
        if self.stopping:
            self._leave(events)
            return
        await asyncio.gather(*(self.sources.ingest(e.message, processor) for e in events))
        for event in events:
            await stream.ack(event)

    async def _run(self, stream: faust.Stream[Any], lane: Lane) -> None:
        settings = self.settings
        processor = self._processor_now()
        dispatcher = Dispatcher(slots=self.slots, lane=lane)
        self._dispatchers[lane] = dispatcher
        self._streams[lane] = stream
        lane_name = lane.name.lower()
        m = self.metrics
        try:
            waiting_since = time.monotonic()
            # While a quarter of the slots are free a record's call starts at once; nearer
            # the limit (its records would wait for slots) batches gather for the window:
            # handing out each record as a slot frees cost 0.4 ms a task at saturation.
            async for events in take(stream, settings.batch.size, within=settings.batch.window_s,
                                     eager=lambda: self.slots.idle_for(lane)):  # fmt: skip
                m.batch_size.observe(len(events))
                m.batch_fill.observe(time.monotonic() - waiting_since)
                for i, event in enumerate(events):
                    if self.stopping:  # not started, not acked: the next owner runs them
                        self._leave(events[i:])
                        break
                    message = event.message
                    m.tasks_received.labels(lane_name).inc()
                    if message.timestamp:
                        m.taken_after.labels(lane_name).observe(
                            max(0.0, time.time() - message.timestamp)
                        )
                    m.unfinished.inc()
                    # One at a time per task, and per session: a turn's prompt needs the
                    # turns before it answered.
                    order_key = processor.intake.session_hint(message.value) or (
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
            await self._finish([dispatcher])
            await self._lane_stopped(processor)

    async def _finish(self, dispatchers: list[Dispatcher]) -> None:
        """Stopping: the started tasks finish and write within the shutdown grace (less a
        margin to close the clients); the rest are cancelled and stay unacked."""
        budget = self.watchdog.for_tasks()
        drained = asyncio.gather(*(d.drain() for d in dispatchers))
        try:
            async with asyncio.timeout(budget):
                await asyncio.shield(drained)
        except (TimeoutError, asyncio.CancelledError):
            for dispatcher in dispatchers:
                await dispatcher.cancel()

    def begin_stop(self) -> None:
        """A stop has begun (a signal, or the worker stopping itself): no record is started
        any more, the started ones finish (within the shutdown grace), and the records
        taken but not started are left unacked to the partition's next owner at once —
        not run first at the rate limit's pace, each a call the group waits for."""
        if self.stopping:
            return
        self.stopping = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop (never started): nothing runs
            return
        # Held: the loop keeps only a weak reference to a task.
        self._finishing = loop.create_task(self._finish_started())

    def _leave(self, events: list[Any] | None) -> None:
        """Records taken and, a stop begun, never to be started here (`events`, or every
        one not acked): left unacked to the partition's next owner, and counted."""
        messages = None if events is None else [e.message for e in events]
        self._left_at_stop += faust_private.forget_unacked(self.app.consumer, messages)

    async def _finish_started(self) -> None:
        await self._finish(list(self._dispatchers.values()))
        try:
            self._leave(None)
        except Exception as exc:  # no consumer (never started): nothing waits for acks
            log.debug("no taken records to leave: %r", exc)
            return
        log.info("stopping: the started tasks are done; %d taken and not started are left "
                 "unacknowledged for the partitions' next owner", self._left_at_stop)  # fmt: skip

    def _job(
        self,
        stream: faust.Stream[Any],
        ticket: Ticket[Any],
        processor: TaskProcessor,
        taken_at: float,
    ) -> Callable[[], Any]:
        async def job() -> None:
            assert self._flow is not None  # made with the processor
            try:
                kind = await self._flow.run(ticket.item.message, taken_at)
            except (CannotWrite, asyncio.CancelledError):
                raise  # the worker is stopping: the record stays unacked
            except Exception as exc:
                # A bug past the record's own `internal_error` path (its dead letter's
                # write, its metrics): neither answered nor acked, so its partition's
                # commit could never pass it, and every later record's ack would wait in
                # memory. The worker stops instead, as when it cannot write: the record
                # runs again after the restart, and a bug that stays is a crash loop an
                # operator sees, not a commit stalled for good.
                message = ticket.item.message
                log.critical("record %s/%d/%d neither answered nor dead-lettered",
                             message.topic, message.partition, message.offset,
                             exc_info=True)  # fmt: skip
                await self.writer.crash(exc)
                return
            if kind is Ended.RELEASED:  # not acked, nor waited for: its partition's owner runs it
                with contextlib.suppress(Exception):  # no consumer (stopping)
                    faust_private.forget_unacked(self.app.consumer, [ticket.item.message])
                if ticket.item.message.partition not in self.store.owned():
                    # Started after the rebalance that gave its partition away had forgotten
                    # the partition's records (the lane held it across): forgotten now, or
                    # it stayed taken and unfinished until the partition came back.
                    self._forget({ticket.partition})
                return
            for done in self.acks.finished(ticket):  # parked too: the ledger holds it
                await stream.ack(done)
                self.metrics.unfinished.dec()

        return job

    async def _run_parked(self, message: StoredRecord) -> Ended | None:
        """A parked record run again; what it ended as (None: stopping, not run)."""
        if self._flow is None:
            return None
        return await self._flow.run(message, time.monotonic())
