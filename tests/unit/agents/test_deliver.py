"""Writing an outcome through the task store: a failed write is written again, and a
worker that cannot write stops (the record stays unacked, so it runs again after the restart)."""

from __future__ import annotations

import asyncio
from typing import Any

import faust
import pytest
from aiokafka.errors import KafkaTimeoutError

from streams.agents import tasks as tasks_module
from streams.agents.tasks import SEND_ATTEMPTS, TaskAgent
from streams.eos import PartitionLost
from streams.processing.processor import Outcome
from streams.records import Source
from streams.settings import load_settings
from streams.state import Kind
from streams.topics import ledger_topic, state_topic

OUTCOME = Outcome(kind="result", key="rk1-x", value=b"{}", task_id="t1")
SOURCE = Source(topic="t", partition=3, offset=1)


class FlakyBroker:
    """Stands in for the store's writes: the first `failures` fail."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sends: list[tuple[str, bytes, bytes, int]] = []

    async def send(
        self, topic: str, key: bytes, value: bytes, partition: int, headers: Any = None
    ) -> None:
        self.sends.append((topic, key, value, partition))
        if len(self.sends) <= self.failures:
            raise KafkaTimeoutError("broker away")


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> TaskAgent:
    async def no_sleep(_: float) -> None:
        return None

    monkeypatch.setattr(tasks_module.asyncio, "sleep", no_sleep)
    app = faust.App("deliver-test", broker="kafka://127.0.0.1:1", autodiscover=False)
    return TaskAgent(app, load_settings(), make_processor=lambda: None)  # type: ignore[arg-type,return-value]


async def test_a_failed_write_is_written_again_until_the_broker_takes_it(agent: TaskAgent) -> None:
    broker = FlakyBroker(failures=3)
    agent.store._send = broker.send
    agent.store._maps[3] = {kind: {} for kind in Kind}  # partition 3 is owned
    await agent._deliver(OUTCOME, None, SOURCE)
    results = agent.settings.topics.results
    # Written to the record's own partition, until the broker took it; then kept.
    assert broker.sends == [(results, b"rk1-x", b"{}", 3)] * 4
    assert agent.store.get(Kind.RESULTS, 3, b"rk1-x") == b"{}"


async def test_a_write_for_a_partition_given_away_reaches_the_topic_only(
    agent: TaskAgent,
) -> None:
    broker = FlakyBroker(failures=0)
    agent.store._send = broker.send
    await agent._deliver(OUTCOME, None, SOURCE)
    assert len(broker.sends) == 1
    assert agent.store.get(Kind.RESULTS, 3, b"rk1-x") is None


async def test_a_worker_that_cannot_write_crashes_instead_of_acking(
    agent: TaskAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashed: list[BaseException] = []

    async def crash(exc: BaseException) -> None:
        crashed.append(exc)

    monkeypatch.setattr(agent.app, "crash", crash)
    broker = FlakyBroker(failures=1000)
    agent.store._send = broker.send
    dead = Outcome(kind="dead_letter", key="t1", value=b"{}", task_id="t1")
    with pytest.raises(KafkaTimeoutError):
        await agent._deliver(dead, None, SOURCE)
    assert len(broker.sends) == SEND_ATTEMPTS
    assert {s[0] for s in broker.sends} == {agent.settings.topics.dead_letters}
    assert len(crashed) == 1


def test_the_store_shares_the_task_topics_partitions(agent: TaskAgent) -> None:
    s = agent.settings
    # The results and dead-letter topics ARE the store's maps: one write, nothing extra.
    assert agent.store.topics == {
        Kind.RESULTS: s.topics.results,
        Kind.DEAD_LETTERS: s.topics.dead_letters,
        Kind.TASKS: state_topic(s),
        Kind.LEDGER: ledger_topic(s),
    }
    for topic in (agent.results_topic, agent.dead_letter_topic, agent.state_topic,
                  agent.ledger_topic):  # fmt: skip
        assert topic.partitions == s.kafka.partitions


async def test_the_store_follows_the_assignment_of_the_task_topics(agent: TaskAgent) -> None:
    class TP:
        def __init__(self, topic: str, partition: int) -> None:
            self.topic, self.partition = topic, partition

    loaded: list[int] = []

    async def load(partition: int) -> None:
        loaded.append(partition)

    store: Any = agent.store
    store._load = load
    t = agent.settings.topics
    await agent._on_assigned(agent.app, {TP(t.tasks, 0), TP(t.replay, 0), TP(t.tasks, 2),
                                         TP("other", 5)})  # fmt: skip
    await asyncio.gather(*store._loading.values())  # (the fixture made asyncio.sleep a no-op)
    assert agent.store.owned() == {0, 2}
    await agent._on_assigned(agent.app, {TP(t.tasks, 2), TP(t.tasks, 4)})
    await asyncio.gather(*store._loading.values())
    assert agent.store.owned() == {2, 4}
    assert sorted(loaded) == [0, 2, 4]  # 2 was kept, not loaded again
    await agent.store.close()


async def test_exactly_once_a_write_for_a_partition_lost_is_dropped_not_retried(
    agent: TaskAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashed: list[BaseException] = []

    async def crash(exc: BaseException) -> None:
        crashed.append(exc)

    async def lost(
        topic: str, key: bytes, value: bytes, partition: int, headers: Any = None
    ) -> None:
        raise PartitionLost(f"partition {partition}: fenced by its new owner")

    monkeypatch.setattr(agent.app, "crash", crash)
    agent.store._send = lost
    await agent._deliver(OUTCOME, None, SOURCE)  # returns: the new owner answers it
    assert not crashed
