"""The sources agent's ingest, without Faust or Kafka: whatever a source record's data
leads a mapping to (a filter comparing text with a number, a template dividing by
zero, a header without a value, a bug in the mapping) ends as that record's dead
letter or its task, and the ingest goes on to the next record."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import orjson
import pytest

from streams.contract.records import EraseRequest, Task
from streams.errors import Category, StreamsError, WriteRefused
from streams.kafka.limits import WriteLimits
from streams.kafka.routing import partition_of
from streams.observability.metrics import Metrics
from streams.pipelines.sinks import SinkSpec
from streams.pipelines.sources import SourceMapper, SourceSpec, jsonable
from streams.pipelines.specs import SessionSpec
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
    """What the ingest writes: tasks forwarded, dead letters delivered — each outside
    every transaction (`plain`: a source partition is no task partition)."""

    def __init__(self) -> None:
        self.forwarded: list[dict[str, Any]] = []
        self.placed: list[tuple[bytes, int]] = []  # each forward's key and partition
        self.dead: list[StreamsError] = []
        self.refused: set[bytes] = set()  # task ids whose forward the broker refuses for good

    async def send(self, topic: str, key: bytes, value: bytes, partition: int,
                   headers: list[tuple[str, bytes]], *, plain: bool = False) -> int:  # fmt: skip
        assert plain, "a source record's forward in a task partition's transaction"
        self.forwarded.append(orjson.loads(value))
        self.placed.append((key, partition))
        return 0

    async def forward(self, topic: str, key: bytes, value: bytes, partition: int,
                      headers: list[tuple[str, bytes]], *, what: str, plain: bool = False) -> None:  # fmt: skip
        if key in self.refused:  # the broker's refusal for good, as `worker.writer` says it
            raise WriteRefused(f"{topic} refused {what} (invalid_record)", code="invalid_record")
        await self.send(topic, key, value, partition, headers, plain=plain)

    async def deliver(self, outcome: StreamsError, partition: int, *, plain: bool = False) -> None:
        assert plain, "a source record's dead letter through the task store"
        self.dead.append(outcome)


class Processor:
    def dead_letter(self, exc: StreamsError, raw: Any, key: Any, source: Any,
                    pipeline: str | None = None) -> StreamsError:  # fmt: skip
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


async def test_a_pipeline_whose_sink_needs_the_record_gets_it_in_the_task() -> None:
    """Its value as decoded, its key, the headers the sink carries, and where it was read:
    what an enriched sink record is made of; a pipeline without such a sink gets none."""
    writer = Writer()
    sink = SinkSpec(topic="shop.reviews.analysed", key="source_key", headers=["origin"])
    mappers = {"shop.reviews": [SourceMapper("reviews", SPEC, sink),
                                SourceMapper("plain", SPEC)]}  # fmt: skip
    ingest = SourceIngest(load_settings(), mappers, writer, WriteLimits(), Metrics())  # type: ignore[arg-type]
    message = Message(change(1, 4), key=b"rev-1", headers=[("origin", b"eu"), ("x", b"y")],
                      partition=2, offset=9)  # fmt: skip
    await ingest.ingest(message, Processor())  # type: ignore[arg-type]
    kept, plain = writer.forwarded
    assert kept["source_record"] == {
        "topic": "shop.reviews", "partition": 2, "offset": 9, "key": "rev-1",
        "value": orjson.loads(change(1, 4)), "headers": {"origin": "eu"},
    }  # fmt: skip
    assert "source_record" not in plain
    assert Task.model_validate(kept).source_record is not None  # as the contract reads it


async def test_a_key_that_is_not_utf8_reaches_the_task_and_its_erasure_as_read() -> None:
    """A LongSerializer's key: the task and the erasure carry its bytes, in what the
    contract reads (a sink keyed by it writes and erases under them)."""
    writer = Writer()
    spec = SourceSpec(topics=["shop.reviews"], task_id="key", slots={"text": "/after/body"},
                      erase={"when": "value.op == 'd'"})  # fmt: skip
    sink = SinkSpec(topic="shop.reviews.analysed", key="source_key")
    mappers = {"shop.reviews": [SourceMapper("reviews", spec, sink)]}
    ingest = SourceIngest(load_settings(), mappers, writer, WriteLimits(), Metrics())  # type: ignore[arg-type]
    raw = (255).to_bytes(8, "big")
    await ingest.ingest(Message(change(1, 4), key=raw), Processor())  # type: ignore[arg-type]
    await ingest.ingest(Message(orjson.dumps({"op": "d"}), key=raw), Processor())  # type: ignore[arg-type]
    assert writer.dead == []
    task, request = writer.forwarded
    assert base64.b64decode(Task.model_validate(task).source_record.key_base64 or "") == raw  # type: ignore[union-attr]
    erase = EraseRequest.model_validate(request)
    assert erase.task_id == task["task_id"] == erase.source_key
    assert base64.b64decode(erase.source_key_base64 or "") == raw


def test_a_decoded_record_is_kept_as_json_holds_it() -> None:
    decoded = {"id": 7, "price": Decimal("9.99"), "raw": b"\x00\x01", 3: "three"}
    assert jsonable(decoded) == {"id": 7, "price": "9.99", "raw": "AAE=", "3": "three"}


async def test_a_record_the_task_topic_could_not_take_is_its_dead_letter() -> None:
    """Each of these used to raise out of the ingest — the sources agent's crash, and the
    same record again after the restart — or to forward what the task topic must refuse:
    a value nested deeper than it could be written back, a task id longer than the
    contract's (as a record key: the forward's own key), an erasure naming such a task,
    an erasure carrying a key larger than a task record may be."""
    writer = Writer()
    spec = SourceSpec(topics=["shop.reviews"], task_id="key", slots={"text": "/after/body"},
                      erase={"when": "value.op == 'd'",
                             "task_id": "{{ value.before.id }}"})  # fmt: skip
    mappers = {"shop.reviews": [SourceMapper("reviews", spec)]}
    limits = WriteLimits(producer_bytes=16_384)  # a value of the task topic: 12,288 bytes
    ingest = SourceIngest(load_settings(), mappers, writer, limits, Metrics())  # type: ignore[arg-type]

    def delete(row_id: str) -> bytes:
        return orjson.dumps({"op": "d", "before": {"id": row_id}})

    deep = b'{"op": "c", "after": {"body": ' + b"[" * 300 + b"]" * 300 + b"}}"  # a slot
    hostile = [
        (Message(deep, key=b"r-1"), "source_too_deep"),
        (Message(change(2, 4), key=b"r" * 600), "source_key"),
        (Message(delete("x" * 600), key=b"r-3"), "source_erase"),
        (Message(delete("r-4"), key=b"k" * 20_000), "source_too_large"),
    ]
    for offset, (message, _) in enumerate(hostile):
        message.offset = offset
        await ingest.ingest(message, Processor())  # type: ignore[arg-type]
        await ingest.ingest(Message(change(offset, 4), key=f"ok-{offset}".encode()),
                            Processor())  # type: ignore[arg-type]  # fmt: skip
    assert [(e.category, e.code) for e in writer.dead] == [
        (Category.INVALID_INPUT, code) for _, code in hostile
    ]
    assert "600 characters long, over the 512" in writer.dead[1].message
    assert [t["task_id"] for t in writer.forwarded] == [f"ok-{i}" for i in range(len(hostile))]


async def test_a_task_the_broker_refuses_for_good_is_its_source_records_dead_letter(
    ingest: tuple[SourceIngest, Writer, Metrics],
) -> None:
    """A forward the task topic refuses for good (a broker's record policy) stopped the
    worker — and again on the same record after every restart. It is the source record's
    dead letter now, and the ingest goes on."""
    ingest_, writer, _ = ingest
    writer.refused.add(b"review-1")
    for offset in range(3):
        message = Message(change(offset, 4), headers=[("origin", b"web")], offset=offset)
        await ingest_.ingest(message, Processor())  # type: ignore[arg-type]
    assert [(e.category, e.code) for e in writer.dead] == [
        (Category.WRITE_REFUSED, "invalid_record")
    ]
    assert [t["task_id"] for t in writer.forwarded] == ["review-0", "review-2"]


async def test_a_sessions_turns_go_to_their_sessions_partition_in_their_order() -> None:
    """A chat topic mapped to a pipeline keeping sessions by `input.chat`: each turn was
    forwarded keyed by its task id, to a partition of its own, and from there again to its
    session's — turns of one chat from several partitions, in whichever order they came,
    where a session's turns must come in order. They go to their session's partition, keyed
    as the publisher keys them."""
    writer = Writer()
    spec = SourceSpec(topics=["chats"], task_id="/id", slots={"text": "/text", "chat": "/chat"})
    mapper = SourceMapper("support", spec, session=SessionSpec(key="input.chat"))
    settings = load_settings()
    source = SourceIngest(settings, {"chats": [mapper]}, writer, WriteLimits(), Metrics())  # type: ignore[arg-type]
    for offset in range(4):
        turn = {"id": f"turn-{offset}", "text": f"message {offset}", "chat": "c-7"}
        await source.ingest(Message(orjson.dumps(turn), topic="chats", offset=offset),
                            Processor())  # type: ignore[arg-type]  # fmt: skip
    home = partition_of(b"c-7", settings.kafka.partitions)
    assert writer.placed == [(b"c-7", home)] * 4
    assert [t["task_id"] for t in writer.forwarded] == [f"turn-{i}" for i in range(4)]
    alone = SourceMapper("support", spec)  # a pipeline keeping no sessions: by its task id
    source = SourceIngest(settings, {"chats": [alone]}, writer, WriteLimits(), Metrics())  # type: ignore[arg-type]
    await source.ingest(Message(orjson.dumps({"id": "t-9", "text": "x", "chat": "c-7"}),
                                topic="chats"), Processor())  # type: ignore[arg-type]  # fmt: skip
    assert writer.placed[-1] == (b"t-9", partition_of(b"t-9", settings.kafka.partitions))
