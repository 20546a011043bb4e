"""An operator command's writes: a record refused for good is said and the rest go on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from aiokafka.errors import (
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    TopicAuthorizationFailedError,
)

from streams.kafka.publisher import Sends
from streams.kafka.topics import state_topic
from streams.ops import redrive as redrive_module
from streams.settings import Settings, load_settings
from tests.unit.ops.test_scans import Rec, serving, state


class Producer:
    """A producer that refuses some records at once (as aiokafka does past its
    max_request_size) and some at their ack (as a broker does), by value."""

    def __init__(self, at_once: set[bytes], at_ack: dict[bytes, Exception]) -> None:
        self.at_once, self.at_ack = at_once, at_ack
        self.sent: list[bytes] = []

    async def send(self, topic: str, *, value: bytes, **record: Any) -> asyncio.Future[Any]:
        if value in self.at_once:
            raise MessageSizeTooLargeError("The message is 2000000 bytes when serialized")
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if value in self.at_ack:
            done.set_exception(self.at_ack[value])
        else:
            self.sent.append(value)
            done.set_result(None)
        return done

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


async def test_refusals_for_good_are_counted_and_named_and_the_rest_acked() -> None:
    producer = Producer({b"big"}, {b"denied": TopicAuthorizationFailedError()})
    sends = Sends(producer)  # type: ignore[arg-type]
    for value in (b"a", b"big", b"b", b"denied", b"c"):
        await sends.send(value.decode(), "t", value=value)
    assert await sends.wait() == ["denied"]
    assert sends.acked == 3 and producer.sent == [b"a", b"b", b"c"]
    assert dict(sends.refused) == {"record_too_large": 1, "not_authorized": 1}
    assert sends.said() == ("refused for good: 1 not_authorized, 1 record_too_large "
                            "(big, denied)")  # fmt: skip


async def test_a_topic_refusing_every_record_is_named_and_logged_ten_times(
    caplog: pytest.LogCaptureFixture,
) -> None:
    values = [f"r{i}".encode() for i in range(1_000)]
    sends = Sends(Producer(set(), {v: TopicAuthorizationFailedError() for v in values}))  # type: ignore[arg-type]
    for value in values:
        await sends.send(value.decode(), "t", value=value)
    assert len(await sends.wait()) == 1_000 and sends.refused["not_authorized"] == 1_000
    assert len(sends.refused_names) == 10 and len(caplog.records) == 10


async def test_a_failure_a_retry_may_mend_is_raised_once_every_record_has_its_answer() -> None:
    """The first record's ack times out; the records after it are still waited for and
    counted (none left unawaited, its failure never retrieved), then the timeout raised."""
    producer = Producer(
        set(), {b"slow": KafkaTimeoutError(), b"denied": TopicAuthorizationFailedError()}
    )
    sends = Sends(producer)  # type: ignore[arg-type]
    later: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    failing_later: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    for value in (b"slow", b"a", b"denied"):
        await sends.send(value.decode(), "t", value=value)
    sends._pending += [("later", "t", later), ("failing", "t", failing_later)]
    asyncio.get_running_loop().call_later(0.01, later.set_result, None)
    asyncio.get_running_loop().call_later(0.01, failing_later.set_exception, KafkaTimeoutError())
    with pytest.raises(KafkaTimeoutError):
        await sends.wait()
    assert later.done() and failing_later.done()
    assert sends.acked == 2 and dict(sends.refused) == {"not_authorized": 1}
    assert sends._pending == []


async def test_a_redrive_sends_the_letters_its_topic_takes_and_says_the_one_it_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings: Settings = load_settings()
    source = {"topic": "llm-tasks", "partition": 0, "offset": 1}

    def letter(i: int) -> bytes:
        return orjson.dumps({"task_id": f"t-{i}", "error": {"category": "timeout"},
                             "payload": {"task_id": f"t-{i}", "pipeline": "p",
                                         "input": {"text": "big" if i == 1 else "x"}},
                             "source": source, "failed_at": "2026-12-06T00:00:00+00:00"})  # fmt: skip

    def letters() -> Iterator[Rec]:
        for i in range(3):
            yield Rec(settings.topics.dead_letters, f"r-{i}".encode(), letter(i))

    def states() -> Iterator[Rec]:
        for i in range(3):
            yield Rec(state_topic(settings), f"t-{i}".encode(),
                      state(f"t-{i}", "dead_lettered", source=source))  # fmt: skip

    big = orjson.dumps({"task_id": "t-1", "pipeline": "p", "input": {"text": "big"}})
    producer = Producer({big}, {})
    serving(monkeypatch, {settings.topics.dead_letters: letters, state_topic(settings): states})
    monkeypatch.setattr(redrive_module.clients, "producer", lambda *a, **kw: producer)
    plan = await redrive_module.redrive(settings, {"timeout"}, None, dry_run=False)
    assert len(plan.requeue) == 3 and plan.sent == 2 and len(producer.sent) == 2
    assert plan.refused == "refused for good: 1 record_too_large (t-1)"
