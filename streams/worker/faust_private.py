"""Every use of Faust's (and its aiokafka clients') private attributes, in one place;
and its consumer on the app's loop (`InLoopTransport`, below), built on them.

faust-streaming 0.15.3 offers no public way to do these; each is pinned by the
tests that exercise it (exactly-once commits, lag on /metrics, the rejoin after a
fence), so an upgrade that moves one fails there, not in production.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from time import monotonic
from types import SimpleNamespace
from typing import Any, ClassVar

from faust.transport import consumer as faust_consumer_module
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP
from faust.utils import terminal as faust_terminal
from mode import Service
from mode.utils.futures import maybe_async

Commit = Callable[[Mapping[Any, int]], Awaitable[bool]]

FETCHER_SAFETY_WAKE_S = 1.0  # aiokafka's `consumer_timeout_ms`, for Faust's consumer


def route_commits(
    consumer: Any, commit: Callable[[Mapping[Any, int], Commit], Awaitable[bool]]
) -> None:
    """Faust calls `consumer._commit(offsets)` with the offsets it found safe to commit;
    send them to `commit` instead (exactly-once: into the partitions' transactions),
    with Faust's own commit for the offsets that go no transaction's way."""
    if getattr(consumer, "_llm_streams_commit", False):
        return
    own: Commit = consumer._commit

    async def routed(offsets: Mapping[Any, int]) -> bool:
        return await commit(offsets, own)

    consumer._commit = routed
    consumer._llm_streams_commit = True


def committed_offsets(consumer: Any) -> Mapping[Any, int]:
    """The offsets Faust last committed (or counted as committed), per TP."""
    found: Mapping[Any, int] = getattr(consumer, "_committed_offset", {})
    return found


def paused_partitions(consumer: Any) -> int:
    """Partitions whose fetching Faust paused because their stream buffer filled."""
    return len(getattr(consumer, "_buffered_partitions", ()))


class _TableWhenLogged:
    """Faust's commit table (`terminal.logtable`), built when its log line is written."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args, self._kwargs = args, kwargs

    def __str__(self) -> str:
        return str(_logtable(*self._args, **self._kwargs))


_logtable = faust_terminal.logtable


def commit_table_when_logged() -> None:
    """Faust's consumer draws a terminal table of the offsets at every commit for a line
    it logs only with mode's DEVLOG on (~30 Python calls a task at 50 tasks/s, for
    nothing): the table is drawn when the line is written instead."""
    setattr(faust_consumer_module, "terminal", SimpleNamespace(logtable=_TableWhenLogged))  # noqa: B010  # a module attribute mypy types as the module


def kafka_consumer_on_loop(consumer: Any) -> Any | None:
    """The aiokafka consumer under Faust's, when it runs on the app's loop (the default)
    and has started; None otherwise (`kafka.consumer_thread`: on a thread of its own)."""
    thread = getattr(consumer, "_thread", None) if isinstance(consumer, InLoopConsumer) else None
    return None if thread is None else thread._consumer


def caught_up(consumer: Any, tp: Any) -> int | None:
    """`tp`'s position when the aiokafka `consumer` has read it to its end as its last
    fetch saw it (the last stable offset; read_uncommitted: the high watermark), else
    None (not there yet, not assigned, or no position or end known)."""
    state = _partition_state(consumer, tp)
    if state is None or not state.has_valid_position:
        return None
    end = state.lso if state.lso is not None and state.lso >= 0 else state.highwater
    position: int = state.position
    return position if end is not None and position >= end else None


def fetch_position(consumer: Any, tp: Any) -> int | None:
    """`tp`'s next offset to fetch in the aiokafka `consumer`, None when unknown."""
    state = _partition_state(consumer, tp)
    return state.position if state is not None and state.has_valid_position else None


def _partition_state(consumer: Any, tp: Any) -> Any | None:
    subscription = consumer._subscription.subscription
    assignment = None if subscription is None else subscription.assignment
    return None if assignment is None else assignment.state_value(tp)


def request_rejoin(consumer: Any) -> None:
    """Make the group member rejoin (eager: every partition is revoked and assigned
    again, and Faust seeks the assigned ones back to their committed offsets), the way
    Kafka Streams enforces a rebalance after a task's producer was fenced. The
    request is handed to the aiokafka consumer's loop (the worker's own, or Faust's
    consumer thread's with `kafka.consumer_thread`)."""
    thread = consumer._thread
    coordinator = thread._ensure_consumer()._coordinator
    thread.thread_loop.call_soon_threadsafe(coordinator.request_rejoin)


async def kafka_producer(app: Any) -> Any:
    """The aiokafka producer under the app's Faust producer (Faust's started first when
    it is not yet)."""
    producer = app.producer._producer
    if producer is None:
        producer = (await app.maybe_start_producer())._producer
    return producer


async def send(
    app: Any, topic: str, key: bytes, value: bytes | None, partition: int, headers: Any
) -> int:
    """One write through the aiokafka producer under the app's Faust producer, returned
    with its offset once acked. Not through Faust's `Topic.send`: its start check, buffer
    and sensors cost ~10 event-loop steps per write, and a thin stream pays them per task."""
    producer = await kafka_producer(app)
    pending = await producer.send(topic, value, key=key, partition=partition, headers=headers)
    metadata = await pending
    return int(metadata.offset)


async def seek_from_committed(consumer: Any) -> Mapping[Any, int | None]:
    """Every partition assigned to the aiokafka `consumer` back at its committed offset —
    or, where none is committed yet, at the log's start (the worker's reset policy,
    `earliest`: worker.app); the committed offsets, as aiokafka's `seek_to_committed`.

    aiokafka's own seeks only where an offset above 0 is committed and leaves the rest
    where the fetches left them. Faust calls it to put back what it fetched and dropped
    unread (a rebalance's seek; a fetch answered while the flow is stopped): a partition
    kept over a rebalance before its first commit stayed past the records fetched in
    the new generation and dropped, and once the records after them were acked, Faust
    committed past them (CI lost the first 17 tasks of one partition so)."""
    committed: Mapping[Any, int | None] = await consumer.seek_to_committed()
    assigned = consumer.assignment()
    never = [tp for tp, offset in committed.items() if not offset and tp in assigned]
    if never:
        await consumer.seek_to_beginning(*never)
    return committed


def transaction_failed(producer: Any) -> BaseException | None:
    """What ended a transactional aiokafka producer for good, or None. A producer whose
    sender died (fenced by a newer epoch of its transactional id, say) goes to aiokafka's
    fatal state and keeps the error for its transaction's waiter; a commit, offsets or
    begin called then fails an assertion of its state machine instead of raising it."""
    manager = getattr(producer, "_txn_manager", None)
    if manager is None or not manager.is_fatal_error():
        return None
    waiter = manager._transaction_waiter
    failed = waiter.exception() if waiter.done() and not waiter.cancelled() else None
    return failed or RuntimeError("the transactional producer failed for good")


def stream_state(consumer: Any, streams: Iterable[Any]) -> dict[str, Any]:
    """Lag per partition (highwater less Faust's committed offset), partitions paused by
    backpressure, and records buffered in `streams` (not yet taken)."""
    committed = committed_offsets(consumer)
    lag: dict[tuple[str, int], int] = {}
    for tp in consumer.assignment():
        highwater = consumer.highwater(tp)
        if highwater is not None:
            lag[(tp.topic, tp.partition)] = max(0, highwater - (committed.get(tp) or 0))
    return {
        "lag": lag,
        "paused": paused_partitions(consumer),
        "buffered": sum(stream.channel.queue.qsize() for stream in streams),
    }


def drain_passively(stream: Any) -> None:
    """Make `stream` consume its channel in the background (its processors then see every
    event), as Faust's own take does (`Stream._enable_passive`)."""
    stream._enable_passive(aiter(stream.channel))


def remove_processor(stream: Any, processor: Callable[..., Any]) -> None:
    """Undo `stream.add_processor(processor)` (Faust has no public way)."""
    stream._processors.remove(processor)


def forget_unacked(consumer: Any, messages: Iterable[Any] | None = None) -> int:
    """Stop Faust's stop from waiting for records taken and never to be acked by this
    worker (its `wait_empty` waits, with no bound, for every record taken from the
    stream): `messages`, or every one not acked. Their offsets stay uncommitted: the
    next owner of the partition runs them. Returns how many were forgotten."""
    unacked = consumer._unacked_messages
    gone = [m for m in (list(unacked) if messages is None else messages) if not m.acked]
    for message in gone:
        unacked.discard(message)
    return len(gone)


class BoundedWaitEmpty:
    """A Faust app whose rebalances wait a bounded time for the records taken to be acked.

    Faust's revocation waits, with no bound, for every record taken from the streams to
    be acked (`App._consumer_wait_empty` -> `consumer.wait_empty`, when
    `stream_wait_empty` is on, its default): one LLM call held by a slow provider, or a
    task waiting for its batch, holds every rebalance of the group that long. Here the
    wait ends after `wait_empty_s` (the worker's stop bound): the records still unacked
    are left — their offsets stay uncommitted and the partitions' owners run them
    again; no run here acks them (the agent forgets their tickets at the assignment).
    Pinned by tests/unit/kafka/test_faust_private.py, which fails if Faust's method goes.
    """

    wait_empty_s: float = 20.0

    async def _consumer_wait_empty(self, consumer: Any, logger: Any) -> None:
        def leave() -> None:
            left = forget_unacked(consumer)
            if left:
                logger.warning("rebalance: %d record(s) still running after %.0fs are left "
                               "unacknowledged to run again", left, self.wait_empty_s)  # fmt: skip

        timer = asyncio.get_running_loop().call_later(self.wait_empty_s, leave)
        try:
            await super()._consumer_wait_empty(consumer, logger)  # type: ignore[misc]  # faust.App's, next in the MRO
        finally:
            timer.cancel()


# Faust's aiokafka consumer on the worker's own event loop, not in a thread of its own.
#
# faust-streaming runs its aiokafka consumer in a dedicated thread with a second event
# loop (`ThreadDelegateConsumer`), so a blocked agent cannot stop the heartbeats. Every
# fetch, commit and seek crosses threads through mode's `MethodQueue`: a
# `call_soon_threadsafe` into the consumer's loop, a worker task there, a second
# `call_soon_threadsafe` back with the result, and the GIL handed between the two loops
# each way. At thin traffic every record pays that alone: measured at 10 tasks/s, the
# consumer thread was ~11 ms/s of CPU (a sixth of the worker's) and a third of the main
# loop's steps per task were the hand-over (bench/BENCHMARKS.md, cpu_per_task).
#
# The worker's agents never block their loop (every LLM call, write and store read is a
# coroutine; the CPU-heavy parts run per record in microseconds), so the heartbeat needs
# no thread of its own. `InLoopConsumer` keeps Faust's aiokafka consumer — its
# configuration, rebalance listener, commit and fetch paths — and only swaps the thread
# for the same service started on the app's loop: a delegated call is a plain `await`.
# Faust offers no setting for this, so the app's transport (`InLoopTransport`) names this
# consumer; the class overrides are mode's `Service` methods that `ServiceThread`
# replaced for its thread, put back. Pinned by every integration test that consumes.


class _OnTheLoop(faust_aiokafka.AIOKafkaConsumerThread):
    """Faust's consumer "thread" as a service on the app's loop: no thread, no second
    loop, no method queue; what the thread version delegates is awaited in place."""

    wait_for_shutdown = False  # the thread version waits for its thread to say it is done

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        loop = kwargs.get("loop") or consumer.loop
        super().__init__(consumer, thread_loop=loop, **{**kwargs, "loop": loop})

    # ServiceThread replaces these for a thread; a service on one loop wants mode's own.
    start = Service.start
    maybe_start = Service.maybe_start
    stop = Service.stop
    set_shutdown = Service.set_shutdown
    _stopped_set = Service._stopped_set
    _stop_children = Service._stop_children
    _stop_futures = Service._stop_futures
    _stop_exit_stacks = Service._stop_exit_stacks

    def _create_worker_consumer(self, transport: Any) -> Any:
        """Faust's consumer, with the fetch wait of the worker's settings (Faust fixes it
        at 1.5 s) and its fetch routine's safety-net wake-up at 1 s, not aiokafka's 0.2
        (both read when the consumer starts). That routine is woken by every event that
        lets it fetch (a fetch answered, records consumed, a seek, a resume, an
        assignment, a metadata update); the timeout only made an idle worker's loop run
        it five times a second for nothing."""
        consumer = super()._create_worker_consumer(transport)
        settings = getattr(self.app, "llm_streams_settings", None)
        if settings is not None:
            consumer._fetch_max_wait_ms = settings.kafka.fetch_max_wait_ms
        consumer._consumer_timeout = FETCHER_SAFETY_WAKE_S
        return consumer

    @Service.task
    async def _thread_keepalive(self) -> None:
        """The thread version wakes its second loop every second; one loop needs nothing."""

    async def on_stop(self) -> None:
        # What the thread does as it ends: leave the group and close the consumer.
        await self.on_thread_stop()

    async def call_thread(
        self, fun: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> Any:
        return await maybe_async(fun(*args, **kwargs))

    async def cast_thread(
        self, fun: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> None:
        await maybe_async(fun(*args, **kwargs))

    async def on_partitions_revoked(self, revoked: set[TP]) -> None:
        await self.consumer.on_partitions_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TP], generation_id: int = 0) -> None:
        await self.consumer.on_partitions_assigned(assigned, generation_id)


def _current() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no loop running: not a task
        return None


class Consumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer with its drain loop (`_drain_messages`) handing a record
    over only while the flow runs, in the generation it was fetched in, and without a
    task per record: Faust hands each record to its conductor in mode's
    `wait_first(callback(message), suspend_flow.wait())` — four tasks, an `asyncio.wait`
    and three cancels per record, so that a rebalance's `stop_flow` can abandon a
    delivery blocked on a full stream buffer. Here the delivery is awaited in place and
    `stop_flow` abandons it by cancelling the drain task at that await, the way
    `asyncio.timeout` interrupts a task (`uncancel`, no task made). Both apps' consumer:
    on Faust's thread (`kafka.consumer_thread`) and on the app's loop (`InLoopConsumer`)."""

    _delivering: asyncio.Task[Any] | None = None  # the drain task, while it delivers
    _abandoning = False

    def ack(self, message: Any) -> bool:
        """Faust's ack, refusing a record no stream took in (`tracked`): a stream acks
        each record it skips, and it skips the ones it takes from its buffer while a
        rebalance or a stop runs — counted done unread, then committed past once the
        records before it are acked. Unacked, it is read again from the committed offset."""
        if not message.tracked:
            return False
        acked: bool = super().ack(message)
        return acked

    async def seek_to_committed(self) -> Mapping[TP, int]:
        """Faust's seek back to the committed offsets (`perform_seek`), where none is
        committed too: `seek_from_committed`."""
        thread = self._thread
        committed: Mapping[TP, int] = await thread.call_thread(
            seek_from_committed, thread._ensure_consumer()
        )
        return committed

    def stop_flow(self) -> None:
        super().stop_flow()
        delivering = self._delivering
        if delivering is not None and not self._abandoning and delivering is not _current():
            self._abandoning = True  # the record is read again after the rebalance
            delivering.cancel()

    async def _deliver(self, message: Any) -> bool:
        """`callback(message)` until done or abandoned by `stop_flow`; whether it was handed
        over. Only while the flow runs, in the generation the record was fetched in: a
        rebalance begun while the drain was elsewhere (its yield, a commit) cancels
        nothing, and a delivery begun after it went through after the next seek — the old
        record acked unread, and a read offset that dropped the records fetched again."""
        if not self.flow_active or message.generation_id != self.app.consumer_generation_id:
            return False
        task = self._delivering = asyncio.current_task()
        try:
            await self.callback(message)
        except asyncio.CancelledError:
            # Ours alone: carry on with the next record; anyone else's: stop.
            if not self._abandoning or task is None or task.uncancel() > 0:
                raise
            return False
        finally:
            self._delivering, self._abandoning = None, False
        return True

    async def _drain_messages(self, fetcher: Any) -> None:  # noqa: C901  # Faust's, as it is
        # faust.transport.consumer.Consumer._drain_messages (faust-streaming 0.15.3), with
        # three changes: a record is handed over by `_deliver`, not mode's `wait_first`;
        # the read offset moves only past a record handed over (Faust's moved past an
        # abandoned one too); and the yield after each fetch is a bare
        # `asyncio.sleep(0)`, not mode's `sleep(0)` (a task for `wait_for`, its timeout
        # and its cancel).
        getmany = self.getmany
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        flag_consumer_fetching = CONSUMER_FETCHING
        set_flag = self.diag.set_flag
        unset_flag = self.diag.unset_flag
        commit_every = self._commit_every
        acks_enabled_for = self.app.topics.acks_enabled_for
        yield_every = 100
        num_since_yield = 0
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                set_flag(flag_consumer_fetching)
                ait = getmany(timeout=1.0)
                await asyncio.sleep(0)  # a fetch served from the buffer may never yield
                if not self.should_stop:
                    async for tp, message in ait:
                        num_since_yield += 1
                        if num_since_yield > yield_every:
                            await asyncio.sleep(0)
                            num_since_yield = 0
                        offset = message.offset
                        r_offset = get_read_offset(tp)
                        if r_offset is None or offset >= r_offset:
                            gap = offset - (r_offset or 0)
                            if gap > 1 and r_offset and acks_enabled_for(message.topic):
                                await self._add_gap(tp, r_offset + 1, offset)
                            if commit_every is not None and self._n_acked >= commit_every:
                                self._n_acked = 0
                                await self.commit()
                            if await self._deliver(message):
                                set_read_offset(tp, offset)
                    unset_flag(flag_consumer_fetching)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            unset_flag(flag_consumer_fetching)


class InLoopConsumer(Consumer):
    """`Consumer` with its aiokafka client on the app's loop (`_OnTheLoop`), its commit
    timer asleep while nothing is acked and its livelock check without a task per
    partition."""

    _acked_since: asyncio.Event | None = None  # a record acked since the last commit began

    def _acked_event(self) -> asyncio.Event:
        if self._acked_since is None:
            self._acked_since = asyncio.Event()
        return self._acked_since

    def ack(self, message: Any) -> bool:
        acked: bool = super().ack(message)
        if acked:
            self._acked_event().set()
        return acked

    @Service.task
    async def _commit_handler(self) -> None:
        """Faust's commit timer — a commit every commit interval, whatever was acked —
        asleep while nothing is acked: an idle worker woke for it twice a second, each a
        mode `sleep` (a task for `wait_for`, its timeout and its cancel). The first ack
        after a quiet spell wakes it; what is acked within the interval after it commits
        together, as before, at most one commit an interval."""
        acked = self._acked_event()
        while not self.should_stop:
            await acked.wait()
            await asyncio.sleep(self.commit_interval)
            acked.clear()  # an ack from here on waits for the next commit
            await self.commit()

    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return _OnTheLoop(self, loop=self.loop, beacon=self.beacon)

    async def verify_all_partitions_active(self) -> None:
        """Faust's livelock check (every 2.5 commit intervals), without mode's `sleep(0)`
        before each partition: a task for `wait_for`, its timeout and its cancel per
        partition, two loop steps each, for a check of a few attribute reads. A bare
        yield every 100 partitions keeps a large assignment from holding the loop."""
        now = monotonic()
        for n, tp in enumerate(self.assignment(), 1):
            if n % 100 == 0:
                await asyncio.sleep(0)
            if self.should_stop:
                return
            self.verify_event_path(now, tp)


class Transport(faust_aiokafka.Transport):
    """Faust's aiokafka transport with `Consumer`: its client on Faust's thread."""

    Consumer: ClassVar[Any] = Consumer


class InLoopTransport(faust_aiokafka.Transport):
    """Faust's aiokafka transport with `InLoopConsumer`."""

    Consumer: ClassVar[Any] = InLoopConsumer
