"""The worker's Kafka consumer runs on the app's loop (streams.worker.faust_private.InLoopConsumer); the
integration suite consumes through it (rebalances, fences, stops), these pin its shape. Its
drain loop is the threaded consumer's too (`faust_private.Consumer`, `kafka.consumer_thread`):
those tests run on both."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from faust.types import TP
from faust.types.tuples import ConsumerMessage

from streams.settings import load_settings
from streams.worker import faust_private
from streams.worker.app import create_app

# The drain's tests run on both consumers: on the app's loop and on Faust's thread.
ON_BOTH = pytest.mark.parametrize("thread", [False, True], ids=["in-loop", "threaded"])


def _app(**kafka: Any) -> Any:
    return create_app(load_settings(kafka={"broker_url": "kafka://127.0.0.1:1", **kafka}))


async def test_the_worker_consumes_on_its_own_loop_with_no_second_one() -> None:
    app = _app()
    delegate = app.consumer._thread
    assert isinstance(app.consumer, faust_private.InLoopConsumer)
    assert isinstance(delegate, faust_private._OnTheLoop)
    assert delegate.thread_loop is app.loop is delegate.loop  # no loop of its own

    def where(x: int) -> tuple[int, asyncio.AbstractEventLoop, int]:
        return threading.get_ident(), asyncio.get_running_loop(), x

    async def fails() -> None:
        raise ValueError("from the consumer")

    # What the thread version hands to its loop through a queue is awaited in place.
    ident, loop, x = await delegate.call_thread(_as_coro(where), 7)
    assert (ident, loop, x) == (threading.get_ident(), asyncio.get_running_loop(), 7)
    with pytest.raises(ValueError, match="from the consumer"):
        await delegate.call_thread(fails)


def _as_coro(fun: Any) -> Any:
    async def call(*args: Any) -> Any:
        return fun(*args)

    return call


async def test_rebalance_callbacks_reach_faust_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    app = _app()
    seen: list[tuple[str, Any, int]] = []

    async def assigned(tps: set[TP], generation_id: int = 0) -> None:
        seen.append(("assigned", tps, threading.get_ident()))

    async def revoked(tps: set[TP]) -> None:
        seen.append(("revoked", tps, threading.get_ident()))

    monkeypatch.setattr(app.consumer, "on_partitions_assigned", assigned)
    monkeypatch.setattr(app.consumer, "on_partitions_revoked", revoked)
    tp = TP("llm-tasks", 0)
    await app.consumer._thread.on_partitions_revoked({tp})
    await app.consumer._thread.on_partitions_assigned({tp}, 3)
    me = threading.get_ident()
    assert seen == [("revoked", {tp}, me), ("assigned", {tp}, me)]


async def test_consumer_thread_setting_keeps_fausts_thread_with_the_workers_drain() -> None:
    app = _app(consumer_thread=True)
    assert type(app.consumer) is faust_private.Consumer  # the drain below, on either
    delegate = app.consumer._thread
    assert not isinstance(delegate, faust_private._OnTheLoop)
    assert delegate.thread_loop is not app.loop


class _Fetcher:
    def __init__(self) -> None:
        self._stopped = asyncio.Event()


class _Message:
    key = value = None  # what Faust's drain logs of a record it drops

    def __init__(self, tp: TP, offset: int, generation_id: int = 0) -> None:
        self.tp, self.topic, self.offset = tp, tp.topic, offset
        self.generation_id = generation_id  # the group's generation it was fetched in


@ON_BOTH
async def test_the_drain_loop_delivers_in_place_and_a_rebalance_abandons_a_blocked_one(
    monkeypatch: pytest.MonkeyPatch, thread: bool
) -> None:
    """Faust's drain loop, one task per record fewer: each record is delivered in the
    drain task itself; one blocked on a full buffer is abandoned by `stop_flow` (as
    mode's `wait_first` abandoned it), and none after it is handed over while the flow
    is stopped (Faust's `getmany` stops yielding them; this one goes on)."""
    app = _app(consumer_thread=thread)
    consumer_ = app.consumer
    fetcher = _Fetcher()
    tp = TP("llm-tasks", 0)
    fetches = [[_Message(tp, 0), _Message(tp, 1), _Message(tp, 2)]]
    delivered: list[int] = []
    abandoned: list[int] = []
    blocked = asyncio.Event()
    drain_task = None

    async def getmany(**_: Any) -> Any:
        if not fetches:
            fetcher._stopped.set()  # the fetcher stops after the one fetch
            return
        for message in fetches.pop():
            yield tp, message

    async def callback(message: _Message) -> None:
        assert asyncio.current_task() is drain_task  # in place: no task per record
        if message.offset == 1:  # a full stream buffer: waits for room
            blocked.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                abandoned.append(message.offset)
                raise
        delivered.append(message.offset)

    monkeypatch.setattr(consumer_, "getmany", getmany)
    monkeypatch.setattr(consumer_, "callback", callback)
    drain_task = asyncio.ensure_future(consumer_._drain_messages(fetcher))
    await asyncio.wait_for(blocked.wait(), 5)
    consumer_.stop_flow()  # what a rebalance does first
    await asyncio.wait_for(drain_task, 5)
    assert delivered == [0]
    assert abandoned == [1]
    assert consumer_._read_offset[tp] == 0  # the last record handed over
    assert drain_task.cancelling() == 0


@ON_BOTH
async def test_a_rebalance_while_the_drain_is_away_from_a_delivery_hands_over_nothing_old(
    monkeypatch: pytest.MonkeyPatch, thread: bool
) -> None:
    """The drain is at an await between two deliveries (its commit, its yield every 100
    records) while a whole rebalance goes by: the partition kept, nothing committed for
    it yet, the seek sets its read offset back to none. The record it was about to
    deliver belongs to the old generation: it is not handed over, and the read offset
    stays where the seek put it. Before, the delivery waited for the flow to resume and
    went through: the stream skipped and acked the old record, and the read offset,
    moved to it, made Faust drop the records before it as they were fetched again — and
    commit past them: a run of tasks at the head of a partition lost (CI, a broker
    restart test whose group rebalanced as its third worker joined)."""
    app = _app(consumer_thread=thread)
    consumer_ = app.consumer
    fetcher = _Fetcher()
    tp = TP("llm-tasks", 7)
    app.consumer_generation_id = 1
    fetches = [[_Message(tp, 0, 2), _Message(tp, 1, 2)], [_Message(tp, 42, 1)]]
    delivered: list[tuple[int, int | None]] = []

    async def getmany(**_: Any) -> Any:
        if not fetches:
            fetcher._stopped.set()
            return
        for message in fetches.pop():
            yield tp, message

    async def rebalance() -> None:  # the drain's commit, while the group rebalances
        consumer_.stop_flow()
        app.consumer_generation_id = 2
        consumer_._read_offset[tp] = None  # the seek: no offset committed for the partition
        consumer_.resume_flow()

    async def callback(message: _Message) -> None:
        delivered.append((message.offset, message.generation_id))

    monkeypatch.setattr(consumer_, "getmany", getmany)
    monkeypatch.setattr(consumer_, "callback", callback)
    monkeypatch.setattr(consumer_, "commit", rebalance)
    monkeypatch.setattr(consumer_, "_commit_every", 1)
    consumer_._n_acked = 1  # a commit is due before the next delivery
    await asyncio.wait_for(consumer_._drain_messages(fetcher), 5)
    # The old generation's record 42 is not handed over; the partition's records are
    # read again from its start, none of them dropped.
    assert delivered == [(0, 2), (1, 2)]
    assert consumer_._read_offset[tp] == 1


@ON_BOTH
async def test_a_real_cancel_during_a_delivery_still_stops_the_drain(thread: bool) -> None:
    app = _app(consumer_thread=thread)
    consumer_ = app.consumer
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    consumer_.callback = lambda _: forever()
    task = asyncio.ensure_future(consumer_._deliver(_Message(TP("llm-tasks", 0), 0)))
    await started.wait()
    task.cancel()  # the fetcher stopping
    consumer_.stop_flow()  # and a rebalance at the same moment
    with pytest.raises(asyncio.CancelledError):
        await task
    assert consumer_._delivering is None


@ON_BOTH
async def test_stop_flow_between_deliveries_cancels_nothing(thread: bool) -> None:
    app = _app(consumer_thread=thread)
    consumer_ = app.consumer
    consumer_.callback = _as_coro(lambda _: 5)
    assert await asyncio.wait_for(consumer_._deliver(_Message(TP("llm-tasks", 0), 0)), 5)
    consumer_.stop_flow()  # no delivery in progress
    assert consumer_._delivering is None and not consumer_._abandoning
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_the_consumers_fetch_wait_is_the_settings_not_faust_s() -> None:
    app = _app(fetch_max_wait_ms=100)
    delegate = app.consumer._thread
    consumer = delegate._create_worker_consumer(app.consumer.transport)
    try:
        assert consumer._fetch_max_wait_ms == 100  # Faust fixes 1,500: a record's wait on Tansu
        # aiokafka's 0.2 s safety-net wake-up of its fetch routine, five a second idle
        assert consumer._consumer_timeout == faust_private.FETCHER_SAFETY_WAKE_S == 1.0
    finally:
        await consumer.stop()


async def test_the_livelock_check_visits_every_partition_with_no_task_per_partition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Faust's check slept mode's `sleep(0)` (a task for `wait_for`) before each
    partition; the worker's checks every partition the same, yielding every 100."""
    app = _app()
    consumer_ = app.consumer
    tps = {TP("tasks", p) for p in range(250)}
    checked: list[TP] = []
    monkeypatch.setattr(consumer_, "assignment", lambda: tps)
    monkeypatch.setattr(consumer_, "verify_event_path", lambda now, tp: checked.append(tp))
    made = 0
    loop = asyncio.get_running_loop()
    factory = loop.get_task_factory()

    def counting(loop: Any, coro: Any, **kwargs: Any) -> Any:
        nonlocal made
        made += 1
        return factory(loop, coro, **kwargs) if factory else asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(counting)
    try:
        await consumer_.verify_all_partitions_active()
    finally:
        loop.set_task_factory(factory)
    assert sorted(checked) == sorted(tps) and made == 0


@pytest.mark.parametrize("standbys", [0, 2])
async def test_the_group_is_assigned_by_fausts_copartitioning_assignor(
    standbys: int, tmp_path: Any
) -> None:
    """tasks-p and replay-p are one store partition: Faust's assignor gives them to one
    worker. With no standby asked for, Faust's consumer would take aiokafka's round-robin
    assignor, which split them between two workers (both owning the store partition)."""
    from faust.assignor import PartitionAssignor

    settings = load_settings(kafka={"broker_url": "kafka://127.0.0.1:1"},
                             store_standby_replicas=standbys, data_dir=tmp_path)  # fmt: skip
    app = create_app(settings)
    consumer = app.consumer._thread._create_worker_consumer(app.consumer.transport)
    try:
        strategies = consumer._partition_assignment_strategy
        assert len(strategies) == 1 and isinstance(strategies[0], PartitionAssignor)
        assert strategies[0].replicas == max(1, standbys)
    finally:
        await consumer.stop()


async def test_offsets_commit_an_interval_after_an_ack_and_not_while_nothing_is_acked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Faust's commit timer woke every commit interval (mode's `sleep`, a task each) with
    nothing to commit on an idle worker; the worker's sleeps until a record is acked and
    commits what was acked within the interval after it, together."""
    from faust.types.tuples import Message

    app = _app(commit_interval_s=0.02)
    consumer_ = app.consumer
    commits: list[int] = []

    async def commit(*args: Any, **kwargs: Any) -> bool:
        commits.append(consumer_._n_acked)
        return True

    monkeypatch.setattr(consumer_, "commit", commit)
    monkeypatch.setattr(app.topics, "acks_enabled_for", lambda topic: True)

    def message(offset: int) -> Message:
        return Message("llm-tasks", 0, offset, 0.0, 0, None, b"k", b"v", None)

    handler = asyncio.create_task(faust_private.InLoopConsumer._commit_handler(consumer_))
    try:
        await asyncio.sleep(0.2)  # ten intervals, nothing acked
        assert commits == []
        assert consumer_.ack(message(5)) and consumer_.ack(message(6))
        assert not consumer_.ack(message(6))  # acked already: wakes nothing
        await asyncio.sleep(0.1)
        assert commits == [2]  # both acks in one commit, and none since
        consumer_.ack(message(7))
        await asyncio.sleep(0.1)
        assert commits == [2, 3]
    finally:
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)


@ON_BOTH
async def test_a_record_a_stream_skipped_unread_is_not_committed_past(thread: bool) -> None:
    """A stream skips, and acks, a record it takes from its buffer while a rebalance or a
    stop runs (Faust's flow control suspended) or from an older generation; it never took
    it in. Faust counted that ack: once the records before it were acked, the commit went
    past it, and it was never run. Refused, the record stays below the commit until a run
    of it is acked."""
    app = _app(consumer_thread=thread)
    consumer_ = app.consumer
    app.topics._acking_topics.add("llm-tasks")  # what the task agent's stream declares
    tp = TP("llm-tasks", 3)

    def fetched(offset: int) -> ConsumerMessage:
        message = ConsumerMessage("llm-tasks", 3, offset, 0.0, 0, None, b"k", b"v", None,
                                  tp=tp, generation_id=1)  # fmt: skip
        message.incref()  # the conductor's, per stream it delivers to
        return message

    def taken_in(offset: int) -> ConsumerMessage:
        message = fetched(offset)
        message.tracked = True  # the stream took it in: a run of it acks it
        return message

    consumer_._committed_offset[tp] = 10
    skipped = fetched(14)
    skipped.ack(consumer_)  # the stream's skip path: `event.ack()`
    for offset in range(10, 14):
        assert taken_in(offset).ack(consumer_)
    assert consumer_._new_offset(tp) == 14  # not 15: record 14 was never run
    consumer_._committed_offset[tp] = 14  # committed
    assert taken_in(14).ack(consumer_)  # read again after the rebalance, run and acked
    assert consumer_._new_offset(tp) == 15


class _Fetched:
    """An aiokafka consumer as Faust's seek sees it: what each partition has committed
    (aiokafka seeks, itself, only where an offset above 0 is), and the seeks made."""

    def __init__(self, committed: dict[Any, int | None]) -> None:
        self.committed, self.to_start = committed, list[Any]()

    async def seek_to_committed(self) -> dict[Any, int | None]:
        return dict(self.committed)

    def assignment(self) -> set[Any]:
        return set(self.committed)

    async def seek_to_beginning(self, *tps: Any) -> None:
        self.to_start += tps


async def test_fausts_seek_back_puts_a_partition_never_committed_at_its_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Faust's `perform_seek` (a rebalance's, or a fetch answered while the flow is
    stopped) goes through `seek_from_committed`: the partitions with nothing committed go
    back to their start, not left past records fetched and dropped unread
    (tests/integration/test_consumer.py shows it on a real broker)."""
    app = _app()
    never, zero, some = (TP("llm-tasks", n) for n in range(3))
    fetched = _Fetched({never: None, zero: 0, some: 12})
    monkeypatch.setattr(app.consumer._thread, "_ensure_consumer", lambda: fetched)
    app.consumer._read_offset[never] = 16  # read up to 16 in the generation before
    await app.consumer.perform_seek()
    assert sorted(fetched.to_start) == [never, zero]
    assert app.consumer._read_offset[never] is None  # every record read from there is new
    assert app.consumer._read_offset[some] == 12
