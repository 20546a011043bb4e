"""The sources agent's ingest, without Faust or Kafka: whatever a source record's data
leads a mapping to (a filter comparing text with a number, a template dividing by
zero, a header without a value, a bug in the mapping) ends as that record's dead
letter or its task, and the ingest goes on to the next record."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from streams.errors import Category, StreamsError
from streams.kafka.limits import WriteLimits
from streams.observability.metrics import Metrics
from streams.pipelines.sources import SourceMapper, SourceSpec
from streams.settings import load_settings
from streams.worker.sources import SourceIngest


@dataclass
class Message:
    value: bytes | None
    key: bytes | None = b"k"
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)
    topic: str = "shop.reviews"
    partition: int = 0
    offset: int = 0
    timestamp: float = 1764500000.0


class Writer:
    """What the ingest writes: tasks forwarded, dead letters delivered."""

    def __init__(self) -> None:
        self.forwarded: list[dict[str, Any]] = []
        self.dead: list[StreamsError] = []

    async def send(self, topic: str, key: bytes, value: bytes, partition: int,
                   headers: list[tuple[str, bytes]]) -> int:  # fmt: skip
        self.forwarded.append(orjson.loads(value))
        return 0

    async def write_or_stop(self, write: Callable[[], Awaitable[int]], *, what: str) -> int:
        return await write()

    async def deliver(self, outcome: StreamsError, partition: int) -> None:
        self.dead.append(outcome)


class Processor:
    def dead_letter(self, exc: StreamsError, raw: Any, key: Any, source: Any) -> StreamsError:
        return exc  # the dead letter's error is what the test looks at


SPEC = SourceSpec(topics=["shop.reviews"], task_id="review-{{ value.after.id }}",
                  filter="value.op != 'd' and value.after.stars >= 0",
                  slots={"text": "/after/body", "source": "{{ headers['origin'] }}",
                         "per_star": "{{ 100 // value.after.stars }}"})  # fmt: skip


def change(i: int, stars: object) -> bytes:
    return orjson.dumps({"op": "c", "after": {"id": i, "stars": stars, "body": f"review {i}"}})


@pytest.fixture
def ingest() -> tuple[SourceIngest, Writer, Metrics]:
    writer, metrics = Writer(), Metrics()
    mappers = {"shop.reviews": [SourceMapper("reviews", SPEC)]}
    ingest = SourceIngest(load_settings(), mappers, writer, WriteLimits(), metrics)  # type: ignore[arg-type]
    return ingest, writer, metrics


async def test_a_record_whose_data_an_expression_refuses_is_its_dead_letter(
    ingest: tuple[SourceIngest, Writer, Metrics],
) -> None:
    source, writer, metrics = ingest
    records = [
        Message(change(1, 4), headers=[("origin", b"eu")]),
        Message(change(2, "4 stars"), headers=[("origin", b"eu")]),  # text: the filter's >=
        Message(change(3, 0), headers=[("origin", b"eu")]),  # the slot's 100 // 0
        Message(change(4, 5), headers=[("origin", None)]),  # a header without a value
        Message(change(5, 2), headers=[("origin", b"us")]),
    ]
    for offset, message in enumerate(records):
        message.offset = offset
        await source.ingest(message, Processor())  # type: ignore[arg-type]
    assert [t["task_id"] for t in writer.forwarded] == ["review-1", "review-4", "review-5"]
    assert writer.forwarded[1]["input"]["source"] == "None"  # null, rendered as Jinja does
    assert [(e.category, e.code) for e in writer.dead] == [
        (Category.INVALID_INPUT, "source_filter"), (Category.INVALID_INPUT, "source_slot")]  # fmt: skip
    assert "TypeError: '>=' not supported" in writer.dead[0].message
    assert "ZeroDivisionError" in writer.dead[1].message
    counted = metrics.source_records.labels
    assert counted("reviews", "forwarded")._value.get() == 3
    assert counted("reviews", "dead_letter")._value.get() == 2


async def test_a_bug_in_a_mapping_is_an_internal_error_dead_letter_not_a_crash(
    ingest: tuple[SourceIngest, Writer, Metrics], monkeypatch: pytest.MonkeyPatch
) -> None:
    source, writer, _ = ingest

    def broken(*_: Any, **__: Any) -> Any:
        raise KeyError("a bug")

    (mapper,) = source.mappers["shop.reviews"]
    monkeypatch.setattr(mapper, "map", broken)
    await source.ingest(Message(change(1, 4)), Processor())  # type: ignore[arg-type]
    assert writer.forwarded == []
    (dead,) = writer.dead
    assert (dead.category, dead.code) == (Category.INTERNAL_ERROR, "internal_error")
    assert "a bug" in dead.message
