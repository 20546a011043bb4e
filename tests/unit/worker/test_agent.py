"""The agent's wiring: the store shares the task topics' partitions and follows the
group's assignment of the task topics (both lanes), loading each partition once."""

from __future__ import annotations

import asyncio
from typing import Any

import faust
import orjson
import pytest

from streams.core.decide import Ended
from streams.kafka.topics import ledger_topic, sessions_topic, state_topic
from streams.settings import load_settings
from streams.store import taskstore as store_module
from streams.store.taskstore import Kind
from streams.worker import faust_private
from streams.worker.agent import TaskAgent
from streams.worker.flow import asked
from streams.worker.parked import StoredRecord


@pytest.fixture
def agent() -> TaskAgent:
    app = faust.App("agent-test", broker="kafka://127.0.0.1:1", autodiscover=False)
    return TaskAgent(app, load_settings(), make_processor=lambda: None)  # type: ignore[arg-type,return-value]


def test_the_store_shares_the_task_topics_partitions(agent: TaskAgent) -> None:
    s = agent.settings
    # The results and dead-letter topics ARE the store's maps: one write, nothing extra.
    assert agent.store.topics == {
        Kind.RESULTS: s.topics.results,
        Kind.DEAD_LETTERS: s.topics.dead_letters,
        Kind.TASK_STATES: state_topic(s),
        Kind.LEDGER: ledger_topic(s),
        Kind.SESSIONS: sessions_topic(s),
    }


async def test_the_store_follows_the_assignment_of_the_task_topics(
    agent: TaskAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    class TP:
        def __init__(self, topic: str, partition: int) -> None:
            self.topic, self.partition = topic, partition

    loaded: list[int] = []

    async def load(settings: Any, topics: Any, partition: int, *_: Any) -> dict[Kind, int]:
        loaded.append(partition)
        return dict.fromkeys(Kind, 0)

    monkeypatch.setattr(store_module, "load_partition", load)
    t = agent.settings.topics
    signal = agent.app.on_partitions_assigned
    await signal.send({TP(t.tasks, 0), TP(t.replay, 0), TP(t.tasks, 2), TP("other", 5)})
    for p in (0, 2):
        await agent.store.ready(p)
    assert agent.store.owned() == {0, 2}
    # Partition 4 of 4 was added to the task topic later: no store partition of its own
    # (its topics have none; it never loaded), its records are forwarded (worker.flow).
    await signal.send({TP(t.tasks, 2), TP(t.tasks, 3), TP(t.tasks, 4)})
    await agent.store.ready(3)
    assert agent.settings.kafka.partitions == 4 and agent.store.owned() == {2, 3}
    assert sorted(loaded) == [0, 2, 3]  # 2 was kept, not loaded again
    await agent.store.close()


class Message:
    def __init__(self, headers: list[tuple[str, bytes]]) -> None:
        self.headers = headers


@pytest.mark.parametrize(
    ("headers", "force", "tier", "note"),
    [
        ([], False, None, None),
        ([("llm-streams-force", b"1"), ("llm-streams-tier", b"batch")], True, "batch", None),
        ([("llm-streams-backtrack", b"rerun")], True, None, "backtrack: re-run"),
        ([("llm-streams-backtrack", b"restore")], False, None, "backtrack: restored"),
        ([("llm-streams-tier", b"gold")], False, None, None),  # not a tier: ignored
    ],
)
def test_headers_say_how_a_record_is_answered(
    headers: list[tuple[str, bytes]], force: bool, tier: str | None, note: str | None
) -> None:
    how = asked(Message(headers))
    assert (how.force, how.tier, how.note) == (force, tier, note)


def test_a_parked_record_comes_back_from_the_ledger_as_it_came_in() -> None:
    """What the ledger keeps of a parked record (JSON, as its readers require) is the
    record, byte for byte: key, value (any bytes), headers (one without a value too),
    position."""
    message = StoredRecord(topic="replay", partition=3, offset=41, key=b"task-\xff",
                           value=b'{"task_id": "t"}\x00\xfe', timestamp=1764500000.5,
                           headers=[("llm-streams-tier", b"batch"), ("x", b"\x00"),
                                    ("no-value", None)])  # fmt: skip
    packed = message.pack()
    assert store_module.readable(Kind.LEDGER, packed)
    assert StoredRecord.unpack(packed) == message
    again = StoredRecord.unpack(StoredRecord(**{**message.__dict__, "key": None}).pack())
    assert again.key is None and asked(again).tier is not None


async def test_source_records_taken_after_a_stop_began_are_left_for_the_next_owner(
    agent: TaskAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Event:
        def __init__(self, offset: int) -> None:
            self.message = f"record {offset}"

    class Sources:
        ingested: list[str] = []

        async def ingest(self, message: str, processor: Any) -> None:
            self.ingested.append(message)

    class Stream:
        acked: list[Event] = []

        async def ack(self, event: Event) -> None:
            self.acked.append(event)

    forgotten: list[str] = []

    def forget(consumer: Any, messages: list[str]) -> int:
        forgotten.extend(messages)
        return len(messages)

    monkeypatch.setattr(faust_private, "forget_unacked", forget)
    monkeypatch.setattr(agent.app, "consumer", object(), raising=False)
    sources, stream = Sources(), Stream()
    agent.sources = sources  # type: ignore[assignment]
    first = [Event(0), Event(1)]
    await agent._forward(stream, first, None)  # type: ignore[arg-type]
    assert sources.ingested == ["record 0", "record 1"] and stream.acked == first
    agent.stopping = True  # what `begin_stop` sets first
    await agent._forward(stream, [Event(2), Event(3)], None)  # type: ignore[arg-type]
    assert sources.ingested == ["record 0", "record 1"] and stream.acked == first
    assert forgotten == ["record 2", "record 3"] and agent._left_at_stop == 2


async def test_a_worker_that_cannot_write_begins_the_same_stop_as_a_signal(
    agent: TaskAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's crash (the broker cannot be written to) starts the watchdog, which
    tells the agent: it starts nothing more and leaves every record taken and not acked
    to the partitions' next owner, as a SIGTERM does; the app is crashed after that."""
    order: list[str] = []

    def forget(consumer: Any, messages: Any = None) -> int:
        order.append(f"left {messages}")
        return 3

    async def crash_app(exc: BaseException) -> None:
        order.append(f"app crashed: {exc}")

    monkeypatch.setattr(faust_private, "forget_unacked", forget)
    monkeypatch.setattr(agent.app, "consumer", object(), raising=False)
    monkeypatch.setattr(agent.writer, "_crash_app", crash_app)
    agent.watchdog.grace_s = 3600  # the stop's bound, never reached here
    try:
        assert not agent.stopping
        await agent.writer.crash(RuntimeError("cannot write"))
        assert agent.stopping and agent._finishing is not None
        await agent._finishing
        assert order == ["app crashed: cannot write", "left None"]
        assert agent._left_at_stop == 3
        assert agent.watchdog.started_at is not None
    finally:
        agent.watchdog.cancel()


async def test_records_of_a_partition_given_away_are_acked_by_no_earlier_run(
    agent: TaskAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebalance gives partition 1 away and takes back partition 2, which the store
    had dropped (a fence): their records' earlier runs ack nothing (they run again from
    the committed offset) and Faust's rebalance does not wait for them; partition 0,
    kept, goes on as it was. A job that finds its partition gone acks nothing either."""

    class TP:
        def __init__(self, topic: str, partition: int) -> None:
            self.topic, self.partition = topic, partition

    class Event:
        def __init__(self, tp: TP, offset: int) -> None:
            self.message = type("M", (), {"tp": tp, "offset": offset, "partition": tp.partition})()

    async def empty(*_: Any) -> dict[Kind, int]:
        return dict.fromkeys(Kind, 0)

    forgotten: list[Any] = []

    def forget(consumer: Any, messages: list[Any]) -> int:
        forgotten.extend(messages)
        return len(messages)

    monkeypatch.setattr(store_module, "load_partition", empty)
    monkeypatch.setattr(faust_private, "forget_unacked", forget)
    monkeypatch.setattr(agent.app, "consumer", type("C", (), {
        "topic_partitions": lambda self, t: 4})(), raising=False)  # fmt: skip
    tasks = agent.settings.topics.tasks
    tps = {p: TP(tasks, p) for p in range(3)}
    agent.store.assign({0, 1, 2})
    events = {p: Event(tps[p], 10) for p in range(3)}
    for p in range(3):
        agent.acks.started(tps[p], events[p])
    agent.store.drop(2)  # fenced: its writes since the last checkpoint are gone
    await agent._on_assigned(None, {tps[0], tps[2]})
    assert {m.partition for m in forgotten} == {1, 2}
    assert agent.acks.partitions() == [tps[0]]

    class Stream:
        acked: list[Any] = []

        async def ack(self, event: Any) -> None:
            self.acked.append(event)

    class Released:  # the record's flow: its partition was given away meanwhile
        async def run(self, *_: Any) -> Ended:
            return Ended.RELEASED

    monkeypatch.setattr(agent, "_flow", Released())
    ticket = agent.acks.started(tps[0], Event(tps[0], 11))
    await agent._job(Stream(), ticket, None, 0.0)()  # type: ignore[arg-type]
    assert Stream.acked == [] and forgotten[-1] is ticket.item.message
    assert agent.acks.partitions() == [tps[0]]  # partition 0 is kept: its records go on
    # A record of partition 1 the lane started after the rebalance had given it away
    # (held in the lane across it): released, and not left taken and unfinished.
    agent.metrics.unfinished.set(1)
    late = agent.acks.started(tps[1], Event(tps[1], 12))
    await agent._job(Stream(), late, None, 0.0)()  # type: ignore[arg-type]
    assert Stream.acked == [] and forgotten[-1] is late.item.message
    assert agent.acks.partitions() == [tps[0]]
    assert agent.metrics.unfinished._value.get() == 0
    await agent.store.close()


async def test_a_record_neither_answered_nor_dead_lettered_stops_the_worker_unacked(
    agent: TaskAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug past a record's own `internal_error` path (here: its dead letter's write
    raises a TypeError) used to end in the dispatcher's log line: the record's ticket never
    finished, its partition's commit stopped behind it, and every later ack waited in
    memory. The worker stops instead, as when it cannot write: nothing acked, the record
    runs again after the restart."""
    crashed: list[BaseException] = []

    async def crash(exc: BaseException) -> None:
        crashed.append(exc)

    class Broken:
        async def run(self, *_: Any) -> Ended:
            raise TypeError("a bug in the dead letter's write")

    class Stream:
        acked: list[Any] = []

        async def ack(self, event: Any) -> None:
            self.acked.append(event)

    tp = type("TP", (), {"topic": "tasks", "partition": 0})()
    message = type("M", (), {"tp": tp, "topic": "tasks", "partition": 0, "offset": 7})()
    ticket = agent.acks.started(tp, type("E", (), {"message": message})())
    monkeypatch.setattr(agent, "_flow", Broken())
    monkeypatch.setattr(agent.writer, "crash", crash)
    await agent._job(Stream(), ticket, None, 0.0)()  # type: ignore[arg-type]
    assert [type(e) for e in crashed] == [TypeError]
    assert Stream.acked == [] and not ticket.done  # still unacked: it runs again


async def test_a_parked_record_another_version_wrote_is_read_and_a_broken_one_left() -> None:
    """The ledger outlives a version. A parked record written with more (a newer
    version's field) or less (no key, headers or timestamp) is run as any; one that is
    no parked record is left in the ledger, said in an error — before, either raised out
    of the resumer's job, and a record of a newer version's shape was never run."""
    from streams.core.dispatch import LaneSlots
    from streams.worker.parked import Resumer

    ran: list[StoredRecord] = []
    deleted: list[bytes] = []

    class Store:
        def owned(self) -> set[int]:
            return {0}

        async def put(self, kind: Kind, partition: int, key: bytes, value: None) -> None:
            deleted.append(key)

    async def run(record: StoredRecord) -> Ended:
        ran.append(record)
        return Ended.RESULT

    resumer = Resumer(Store(), LaneSlots(4), run)  # type: ignore[arg-type]
    newer = {"topic": "replay", "partition": 0, "offset": 9, "value": "e30=", "lane": "x"}
    resumer.resume(0, "new", orjson.dumps(newer))
    resumer.resume(0, "broken", b'{"topic": "replay"}')
    resumer.resume(0, "garbage", b"\xff not json")
    await asyncio.sleep(0)  # the submissions
    await resumer._dispatcher.drain()
    assert ran == [StoredRecord("replay", 0, 9, None, b"{}", [], None)]
    assert len(deleted) == 1  # the record run: its entry goes; the broken ones stay
    await resumer.close()
