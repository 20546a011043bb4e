"""Writing an outcome through the task store: a failed write is written again, and a
worker that cannot write stops (the record stays unacked, so it runs again after the restart)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import faust
import orjson
import pytest
from aiokafka.errors import (
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    TopicAuthorizationFailedError,
)

from streams.contract.records import Source
from streams.core.processor import Outcome, Prices, TaskProcessor
from streams.kafka import agent as tasks_module
from streams.kafka.agent import SEND_ATTEMPTS, CannotWrite, TaskAgent
from streams.kafka.eos import PartitionLost
from streams.kafka.store import Kind
from streams.kafka.topics import ledger_topic, state_topic
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.guarded import GuardedClient
from streams.resilience.limiter import RateLimiter
from streams.resilience.retry import RetryPolicy
from streams.settings import load_settings
from tests.fakes import FakeLLM

ROOT = Path(__file__).resolve().parents[3]

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
    agent = TaskAgent(app, load_settings(), make_processor=lambda: None)  # type: ignore[arg-type,return-value]
    # The shutdown watchdog ends the process after its grace: here it only records.
    stops: list[str] = []
    monkeypatch.setattr(agent.watchdog, "start", stops.append)
    agent.stops = stops  # type: ignore[attr-defined]
    return agent


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
    with pytest.raises(CannotWrite):
        await agent._deliver(dead, None, SOURCE)
    assert len(broker.sends) == SEND_ATTEMPTS
    assert {s[0] for s in broker.sends} == {agent.settings.topics.dead_letters}
    assert len(crashed) == 1
    assert len(agent.stops) == 1  # type: ignore[attr-defined]  # the stop is bounded


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


class RefusingBroker:
    """Takes every write except those to `refused` topics, which fail with `error`."""

    def __init__(self, refused: set[str], error: Exception) -> None:
        self.refused, self.error = refused, error
        self.sends: list[tuple[str, bytes, bytes, int]] = []

    async def send(
        self, topic: str, key: bytes, value: bytes, partition: int, headers: Any = None
    ) -> None:
        self.sends.append((topic, key, value, partition))
        if topic in self.refused:
            raise self.error


def _prepared(agent: TaskAgent) -> tuple[Any, Outcome]:
    """A real processor (fake LLM) and a prepared task with its result outcome."""
    processor = TaskProcessor(
        PipelineRegistry.load(ROOT / "pipelines", ROOT / "schemas"),
        GuardedClient(FakeLLM(), limiter=RateLimiter(rpm=None), breaker=CircuitBreaker("f")),
        default_model="fake-1", policy=RetryPolicy(), deadline_s=5, max_task_bytes=10_000,
        prices=Prices(),
    )  # fmt: skip
    agent._processor = processor
    raw = orjson.dumps({"task_id": "t1", "pipeline": "comment-analysis",
                        "input": {"text": "Great phone."}})  # fmt: skip
    prep = processor.prepare(raw, b"t1", SOURCE)
    assert not isinstance(prep, Outcome)
    output = {"sentiment": "positive", "confidence": 0.9, "topics": ["quality"], "issues": [],
              "summary": "good", "language": "en"}  # fmt: skip
    return prep, processor.from_cache(prep, output, "fake-1")


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (MessageSizeTooLargeError("over the topic's max.message.bytes"), "record_too_large"),
        (TopicAuthorizationFailedError("no WRITE on the topic"), "not_authorized"),
    ],
)
async def test_a_result_the_broker_refuses_for_good_becomes_a_write_refused_dead_letter(
    agent: TaskAgent, error: Exception, code: str
) -> None:
    t = agent.settings.topics
    broker = RefusingBroker({t.results}, error)
    agent.store._send = broker.send
    agent.store._maps[3] = {kind: {} for kind in Kind}
    prep, result = _prepared(agent)
    await agent._deliver(result, prep, SOURCE)
    written = [(topic, orjson.loads(value)) for topic, _, value, _ in broker.sends]
    assert [topic for topic, _ in written].count(t.results) == 1  # tried once: no retry
    letters = [v for topic, v in written if topic == t.dead_letters]
    assert len(letters) == 1 and letters[0]["error"]["category"] == "write_refused"
    assert letters[0]["error"]["code"] == code and letters[0]["task_id"] == "t1"
    states = [v for topic, v in written if topic == state_topic(agent.settings)]
    assert states[-1]["status"] == "dead_lettered"  # the state says what was written last
    assert agent.metrics.writes_refused.labels(t.results, code)._value.get() == 1


async def test_a_review_copy_the_broker_refuses_is_left_out_and_the_result_kept(
    agent: TaskAgent,
) -> None:
    t = agent.settings.topics
    broker = RefusingBroker({t.review}, MessageSizeTooLargeError("too large"))
    agent.store._send = broker.send
    agent._send = broker.send  # type: ignore[method-assign]  # the review copy's write
    prep, result = _prepared(agent)
    await agent._deliver(replace(result, review=("low_confidence",)), prep, SOURCE)
    topics = [topic for topic, *_ in broker.sends]
    assert topics.count(t.results) == 1 and topics.count(t.review) == 1
    assert t.dead_letters not in topics


async def test_a_dead_letter_the_broker_refuses_for_good_stops_the_worker(
    agent: TaskAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashed: list[BaseException] = []

    async def crash(exc: BaseException) -> None:
        crashed.append(exc)

    monkeypatch.setattr(agent.app, "crash", crash)
    t = agent.settings.topics
    broker = RefusingBroker({t.dead_letters}, TopicAuthorizationFailedError("no WRITE"))
    agent.store._send = broker.send
    dead = Outcome(kind="dead_letter", key="t1", value=b"{}", task_id="t1")
    with pytest.raises(CannotWrite):
        await agent._deliver(dead, None, SOURCE)
    assert len(broker.sends) == 1 and len(crashed) == 1  # no retry of a refusal


async def test_only_the_writes_that_failed_are_written_again(agent: TaskAgent) -> None:
    t = agent.settings.topics

    class StateFlaky(RefusingBroker):
        async def send(self, topic: str, key: bytes, value: bytes, partition: int,
                       headers: Any = None) -> None:  # fmt: skip
            self.sends.append((topic, key, value, partition))
            if topic == state_topic(agent.settings) and len(self.sends) < 4:
                raise KafkaTimeoutError("broker away")

    broker = StateFlaky(set(), KafkaTimeoutError())
    agent.store._send = broker.send
    prep, result = _prepared(agent)
    await agent._deliver(result, prep, SOURCE)
    topics = [topic for topic, *_ in broker.sends]
    assert topics.count(t.results) == 1  # written once: no duplicate result
    assert topics.count(state_topic(agent.settings)) == 3


async def test_the_state_is_written_only_once_the_outcome_is(agent: TaskAgent) -> None:
    """A state saying this record wrote its outcome must never be ahead of the outcome:
    a kill between the two would leave a record skipped as done with no result."""
    t = agent.settings.topics
    broker = FlakyBroker(failures=2)  # the result's first two writes fail
    agent.store._send = broker.send
    prep, result = _prepared(agent)
    await agent._deliver(result, prep, SOURCE)
    topics = [topic for topic, *_ in broker.sends]
    assert topics == [t.results] * 3 + [state_topic(agent.settings)]
