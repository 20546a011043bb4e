"""The worker's writes: a failed write is written again (only what failed), a write Kafka
refuses for good ends as a dead letter or is left out, the state never goes ahead of
the outcome, and a worker that cannot write stops (the record stays unacked, so it
runs again after the restart)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import orjson
import pytest
from aiokafka.errors import (
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    TopicAuthorizationFailedError,
)

from streams.contract.records import Source
from streams.core.outcome import Outcome, Prepared
from streams.core.taskstate import Status, TaskState
from streams.kafka.limits import WriteLimits
from streams.kafka.topics import state_topic
from streams.observability.metrics import Metrics
from streams.settings import Settings, load_settings
from streams.store import taskstore as store_module
from streams.store.taskstore import Kind, PartitionLost, TaskStore
from streams.worker import writer as writer_module
from streams.worker.shutdown import Watchdog
from streams.worker.writer import SEND_ATTEMPTS, CannotWrite, Writer
from tests.conftest import MakeProcessor
from tests.fakes import FakeLLM

SOURCE = Source(topic="t", partition=3, offset=1)
OUTCOME = Outcome(kind="result", key="rk1-x", value=b"{}", task_id="t1")
GOOD = {"sentiment": "positive", "confidence": 0.9, "topics": ["quality"], "issues": [],
        "summary": "good", "language": "en"}  # fmt: skip


class Broker:
    """The topics as the writer sees them: `fail(topic, n)` says whether the n-th write
    (1-based, over all topics) to `topic` raises, and what."""

    def __init__(self, fail: Callable[[str, int], Exception | None] = lambda t, n: None) -> None:
        self.fail = fail
        self.sends: list[tuple[str, bytes, bytes, int]] = []

    async def send(self, topic: str, key: bytes, value: bytes, partition: int,
                   headers: Any = None) -> None:  # fmt: skip
        self.sends.append((topic, key, value, partition))
        error = self.fail(topic, len(self.sends))
        if error is not None:
            raise error

    def topics(self) -> list[str]:
        return [topic for topic, *_ in self.sends]


class Stops:
    def __init__(self) -> None:
        self.crashed: list[BaseException] = []
        self.watched: list[str] = []

    async def crash(self, exc: BaseException) -> None:
        self.crashed.append(exc)


@pytest.fixture
def settings() -> Settings:
    return load_settings(store="memory://")  # the writer's tests: no store on disk


@pytest.fixture
async def owned(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> Any:
    """A writer over a task store that owns partition 3 (loaded empty), a broker, stops."""

    real_sleep = asyncio.sleep

    async def no_sleep(_: float) -> None:
        await real_sleep(0)  # the backoff skipped, the loop still turns

    async def empty(*_: Any) -> dict[Kind, int]:
        return dict.fromkeys(Kind, 0)

    monkeypatch.setattr(writer_module.asyncio, "sleep", no_sleep)
    monkeypatch.setattr(store_module, "load_partition", empty)

    def build(broker: Broker) -> tuple[Writer, TaskStore, Stops]:
        stops = Stops()
        watchdog = Watchdog(3600, lambda: "")
        monkeypatch.setattr(watchdog, "start", stops.watched.append)  # never ends the tests
        holder: dict[str, Writer] = {}

        async def via_writer(*args: Any, **kwargs: Any) -> None:
            await holder["w"].send(*args, **kwargs)

        store = TaskStore(settings, via_writer)
        writer = Writer(settings, send=broker.send, store=store, eos=None,
                        limits=WriteLimits(), metrics=Metrics(), watchdog=watchdog,
                        crash=stops.crash)  # fmt: skip
        holder["w"] = writer
        store.assign({SOURCE.partition})
        return writer, store, stops

    return build


def _state_for(prep: Prepared) -> Callable[[Outcome], TaskState]:
    def state(outcome: Outcome) -> TaskState:
        status = Status.SUCCEEDED if outcome.kind == "result" else Status.DEAD_LETTERED
        return TaskState(task_id=prep.task.task_id, status=Status.RECEIVED,
                         updated_at="").moved(status, source=prep.source)  # fmt: skip

    return state


@pytest.fixture
def prepared(make_processor: MakeProcessor) -> tuple[Any, Prepared, Outcome]:
    """A processor (fake LLM), a prepared task and its result outcome."""
    processor = make_processor(FakeLLM())
    raw = orjson.dumps({"task_id": "t1", "pipeline": "comment-analysis",
                        "input": {"text": "Great phone."}})  # fmt: skip
    prep = processor.intake.prepare(raw, b"t1", SOURCE)
    assert not isinstance(prep, Outcome)
    return processor, prep, processor.from_cache(prep, GOOD, "fake-1")


async def test_a_failed_write_is_written_again_until_the_broker_takes_it(owned: Any) -> None:
    broker = Broker(lambda t, n: KafkaTimeoutError("broker away") if n <= 3 else None)
    writer, store, _ = owned(broker)
    await store.ready(SOURCE.partition)
    await writer.deliver(OUTCOME, SOURCE.partition)
    results = writer.settings.topics.results
    # Written to the record's own partition, until the broker took it; then kept.
    assert broker.sends == [(results, b"rk1-x", b"{}", 3)] * 4
    assert store.get(Kind.RESULTS, 3, b"rk1-x") == b"{}"


async def test_a_write_for_a_partition_given_away_reaches_the_topic_only(owned: Any) -> None:
    broker = Broker()
    writer, store, _ = owned(broker)
    await writer.deliver(OUTCOME, 2)  # partition 2 is not this worker's
    assert len(broker.sends) == 1 and store.get(Kind.RESULTS, 2, b"rk1-x") is None


async def test_a_worker_that_cannot_write_stops_instead_of_acking(owned: Any) -> None:
    broker = Broker(lambda t, n: KafkaTimeoutError("broker away"))
    writer, _, stops = owned(broker)
    dead = Outcome(kind="dead_letter", key="t1", value=b"{}", task_id="t1")
    with pytest.raises(CannotWrite):
        await writer.deliver(dead, SOURCE.partition)
    assert broker.topics() == [writer.settings.topics.dead_letters] * SEND_ATTEMPTS
    assert len(stops.crashed) == 1 and len(stops.watched) == 1  # the stop is bounded


async def test_exactly_once_a_write_for_a_partition_lost_is_dropped_not_retried(
    owned: Any,
) -> None:
    broker = Broker(lambda t, n: PartitionLost("partition 3: fenced by its new owner"))
    writer, _, stops = owned(broker)
    await writer.deliver(OUTCOME, SOURCE.partition)  # returns: the new owner answers it
    assert len(broker.sends) == 1 and not stops.crashed


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (MessageSizeTooLargeError("over the topic's max.message.bytes"), "record_too_large"),
        (TopicAuthorizationFailedError("no WRITE on the topic"), "not_authorized"),
    ],
)
async def test_a_result_the_broker_refuses_for_good_becomes_a_write_refused_dead_letter(
    owned: Any, prepared: Any, error: Exception, code: str
) -> None:
    processor, prep, result = prepared
    results = load_settings().topics.results
    broker = Broker(lambda t, n: error if t == results else None)
    writer, store, _ = owned(broker)
    await store.ready(SOURCE.partition)
    refusal = await writer.deliver(result, SOURCE.partition, prep=prep,
                                   state=_state_for(prep)(result))  # fmt: skip
    assert refusal is not None and refusal.code == code  # nothing after the result written
    letter = processor.failed(prep, refusal, result)  # what the record's flow writes instead
    assert await writer.deliver(letter, SOURCE.partition, prep=prep,
                                state=_state_for(prep)(letter)) is None  # fmt: skip
    written = [(topic, orjson.loads(value)) for topic, _, value, _ in broker.sends]
    t = writer.settings.topics
    assert broker.topics().count(t.results) == 1  # tried once: no retry
    letters = [v for topic, v in written if topic == t.dead_letters]
    assert len(letters) == 1 and letters[0]["error"]["category"] == "write_refused"
    assert letters[0]["error"]["code"] == code and letters[0]["task_id"] == "t1"
    states = [v for topic, v in written if topic == state_topic(writer.settings)]
    assert [s["status"] for s in states] == ["dead_lettered"]  # after the dead letter only
    assert writer.metrics.writes_refused.labels(t.results, code)._value.get() == 1


async def test_a_review_copy_the_broker_refuses_is_left_out_and_the_result_kept(
    owned: Any, prepared: Any
) -> None:
    _, prep, result = prepared
    review = load_settings().topics.review
    broker = Broker(lambda t, n: MessageSizeTooLargeError("too large") if t == review else None)
    writer, _, _ = owned(broker)
    with_review = replace(result, review=("low_confidence",), review_value=b'{"review": 1}')
    await writer.deliver(
        with_review, SOURCE.partition, prep=prep, state=_state_for(prep)(with_review)
    )
    t = writer.settings.topics
    assert broker.topics().count(t.results) == 1 and broker.topics().count(t.review) == 1
    assert t.dead_letters not in broker.topics()


async def test_a_dead_letter_the_broker_refuses_for_good_stops_the_worker(owned: Any) -> None:
    dead_letters = load_settings().topics.dead_letters
    broker = Broker(lambda t, n: TopicAuthorizationFailedError("no WRITE")
                    if t == dead_letters else None)  # fmt: skip
    writer, _, stops = owned(broker)
    dead = Outcome(kind="dead_letter", key="t1", value=b"{}", task_id="t1")
    with pytest.raises(CannotWrite):
        await writer.deliver(dead, SOURCE.partition)
    assert len(broker.sends) == 1 and len(stops.crashed) == 1  # no retry of a refusal


async def test_only_the_writes_that_failed_are_written_again(owned: Any, prepared: Any) -> None:
    _, prep, result = prepared
    states = state_topic(load_settings())
    broker = Broker(lambda t, n: KafkaTimeoutError("away") if t == states and n < 4 else None)
    writer, _, _ = owned(broker)
    await writer.deliver(result, SOURCE.partition, prep=prep, state=_state_for(prep)(result))
    t = writer.settings.topics
    assert broker.topics().count(t.results) == 1  # written once: no duplicate result
    assert broker.topics().count(states) == 3


async def test_the_state_is_written_only_once_the_outcome_is(owned: Any, prepared: Any) -> None:
    """A state saying this record wrote its outcome must never be ahead of the outcome:
    a kill between the two would leave a record skipped as done with no result."""
    _, prep, result = prepared
    broker = Broker(lambda t, n: KafkaTimeoutError("away") if n <= 2 else None)
    writer, _, _ = owned(broker)
    await writer.deliver(result, SOURCE.partition, prep=prep, state=_state_for(prep)(result))
    t = writer.settings.topics
    assert broker.topics() == [t.results] * 3 + [state_topic(writer.settings)]


async def test_a_state_given_as_a_function_is_made_once_after_the_outcome_is_written(
    owned: Any, prepared: Any
) -> None:
    """Made before, it was on the way of the answer (0.15 ms of a task's path to its
    result's write); made after, with the outcome's write tried three times, it is made
    once and written once."""
    _, prep, result = prepared
    broker = Broker(lambda t, n: KafkaTimeoutError("away") if n <= 2 else None)
    writer, _, _ = owned(broker)
    made: list[list[str]] = []

    def state() -> TaskState:
        made.append(broker.topics())
        return _state_for(prep)(result)

    await writer.deliver(result, SOURCE.partition, prep=prep, state=state)
    t = writer.settings.topics
    assert made == [[t.results] * 3]  # once, after the result was written
    assert broker.topics() == [t.results] * 3 + [state_topic(writer.settings)]


async def test_a_state_written_alone_is_written_again_when_the_broker_hiccups(
    owned: Any,
) -> None:
    """The state an earlier run missed (its answer written already): a timeout is written
    again, not raised into the record's run — where it became an internal_error dead
    letter beside the task's result."""
    broker = Broker(lambda t, n: KafkaTimeoutError("broker away") if n <= 2 else None)
    writer, store, stops = owned(broker)
    await store.ready(SOURCE.partition)
    state = TaskState(task_id="t1", status=Status.SUCCEEDED, updated_at="")
    await writer.put_state(SOURCE.partition, state)
    assert broker.topics() == [state_topic(writer.settings)] * 3
    assert store.get(Kind.TASK_STATES, SOURCE.partition, b"t1") is not None and not stops.crashed


async def test_a_state_written_alone_that_cannot_be_written_stops_the_worker(owned: Any) -> None:
    broker = Broker(lambda t, n: KafkaTimeoutError("broker away"))
    writer, store, stops = owned(broker)
    await store.ready(SOURCE.partition)
    state = TaskState(task_id="t1", status=Status.SUCCEEDED, updated_at="")
    with pytest.raises(CannotWrite):
        await writer.put_state(SOURCE.partition, state)
    assert len(stops.crashed) == 1
