"""A record's way (worker.flow) without Faust or Kafka: a task store over a fake broker, the
writer over it, the processor over a fake LLM. A record is routed to its home before its
prompt is made, answered once, its bad input dead-lettered once."""

from __future__ import annotations

import asyncio
import decimal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiokafka.errors import MessageSizeTooLargeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streams.contract.headers import (
    BACKTRACK_HEADER,
    ERASE_HEADER,
    FORCE_HEADER,
    REPLAY_ID_HEADER,
    REPLAY_OF_HEADER,
    REROUTED_FROM_HEADER,
    RESULT_KEY_HEADER,
    SOURCE_OF_HEADER,
    TIER_HEADER,
)
from streams.contract.lanes import Lane
from streams.contract.records import EraseRequest, Source
from streams.core.cache import ContentCache
from streams.core.decide import Decider, Ended
from streams.kafka.limits import WriteLimits
from streams.kafka.routing import partition_for, partition_of
from streams.kafka.topics import ledger_topic, state_topic
from streams.observability.metrics import Metrics
from streams.pipelines.registry import PipelineRegistry
from streams.settings import load_settings
from streams.store import taskstore
from streams.store.taskstore import Kind, TaskStore
from streams.worker.flow import RecordFlow
from streams.worker.parked import StoredRecord
from streams.worker.shutdown import Watchdog
from streams.worker.writer import Writer
from tests.conftest import MakeProcessor
from tests.fakes import FakeLLM, answer

GOOD = {"sentiment": "positive", "confidence": 0.9, "topics": ["quality"], "issues": [],
        "summary": "good", "language": "en"}  # fmt: skip
PARTITIONS = 4
SINK = "shop.comments.analysed"
ROOT = Path(__file__).resolve().parents[3]


class Span:
    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attributes = attributes


@asynccontextmanager
async def _flow(
    make_processor: MakeProcessor,
    monkeypatch: pytest.MonkeyPatch,
    registry: PipelineRegistry | None = None,
) -> AsyncIterator[Any]:
    async def empty(*_: Any) -> dict[Kind, int]:
        return dict.fromkeys(Kind, 0)

    monkeypatch.setattr(taskstore, "load_partition", empty)
    settings = load_settings(store="memory://", kafka={"partitions": PARTITIONS})
    sent: list[tuple[str, bytes, bytes | None, int, Any]] = []
    refuse: set[str] = set()  # topics that refuse every record for good

    async def broker(topic: str, key: bytes, value: bytes | None, partition: int,
                     headers: Any = None) -> int:  # fmt: skip
        sent.append((topic, key, value, partition, headers))
        if topic in refuse:
            raise MessageSizeTooLargeError("over the topic's max.message.bytes")
        return len(sent)

    store = TaskStore(settings, broker)
    writer = Writer(settings, send=broker, store=store, eos=None,
                    limits=WriteLimits(partitions={SINK: 3}), metrics=Metrics(),
                    watchdog=Watchdog(3600, lambda: ""),
                    crash=lambda exc: None)  # type: ignore[arg-type,return-value]  # fmt: skip
    llm = FakeLLM(lambda _r: answer(GOOD))
    processor = make_processor(llm, registry=registry)
    decider = Decider(processor, store, ContentCache(), processor.metrics, settings.topics.results)
    store.assign(set(range(PARTITIONS)))
    flow = RecordFlow(processor, decider, store, writer, partitions=PARTITIONS,
                      sessions_bytes=1_000_000, lane_of=lambda topic: Lane.LIVE,
                      metrics=processor.metrics)  # fmt: skip
    try:
        yield flow, sent, llm, settings, refuse
    finally:
        await store.close()


def _registry(tmp_path: Path, *, sink: bool = False, session: bool = False) -> PipelineRegistry:
    """The shipped comment pipeline, with a sink (enriched, keyed by task id, its dead
    letters copied to a topic of its own) and keeping sessions (the earlier turns' text and
    label), as asked."""
    spec = yaml.safe_load((ROOT / "pipelines" / "comment-analysis.yaml").read_text())
    if sink:
        spec["sink"] = {"topic": SINK, "dead_letters": f"{SINK}.dlq"}
    if session:
        spec["versions"]["v1"]["session"] = {"budget_tokens": 2000,
                                             "keep": {"slots": ["text"], "fields": ["sentiment"]}}  # fmt: skip
        spec.pop("chunking", None)
    (tmp_path / "comment-analysis.yaml").write_text(yaml.safe_dump(spec))
    return PipelineRegistry.load(tmp_path, ROOT / "schemas")


@pytest.fixture
async def flow(make_processor: MakeProcessor, monkeypatch: pytest.MonkeyPatch) -> Any:
    async with _flow(make_processor, monkeypatch) as made:
        yield made


@pytest.fixture
async def sink_flow(
    make_processor: MakeProcessor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Any:
    """The shipped comment pipeline with a sink: enriched, keyed by task id, its dead
    letters copied to a topic of its own."""
    async with _flow(make_processor, monkeypatch, _registry(tmp_path, sink=True)) as made:
        yield made


@pytest.fixture
async def session_flow(
    make_processor: MakeProcessor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Any:
    """The shipped comment pipeline keeping sessions (the earlier turns' text and label)."""
    async with _flow(make_processor, monkeypatch, _registry(tmp_path, session=True)) as made:
        yield made


def _record(task_id: str, partition: int, offset: int = 0, **extra: Any) -> StoredRecord:
    task = {"task_id": task_id, "pipeline": "comment-analysis",
            "input": {"text": "Great phone, works well."}, **extra}  # fmt: skip
    return StoredRecord("tasks", partition, offset, task_id.encode(), orjson.dumps(task), [], None)


def _home_of(task_id: str) -> int:
    return partition_for(task_id, PARTITIONS)


async def test_a_record_at_home_is_answered_and_its_result_written_once(flow: Any) -> None:
    run, sent, llm, settings, _ = flow
    record = _record("t-1", _home_of("t-1"))
    source = Source(topic="tasks", partition=record.partition, offset=0)
    kind, outcome = await run.handle(record, source, Span())
    assert kind == "result" and outcome is not None and len(llm.requests) == 1
    assert [s[0] for s in sent][:1] == [settings.topics.results]
    again, _ = await run.handle(record, source, Span())  # the same record run again
    assert again == "already_done" and len(llm.requests) == 1


async def test_a_record_away_from_home_is_forwarded_before_its_prompt_is_made(
    flow: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, sent, llm, _, _ = flow
    home = _home_of("t-2")
    away = (home + 1) % PARTITIONS
    prepared: list[Any] = []
    monkeypatch.setattr(run.processor.intake, "prepare", lambda *a, **k: prepared.append(a))
    kind, outcome = await run.handle(_record("t-2", away, 7), Source(topic="tasks",
                                                                  partition=away, offset=7),
                                     Span())  # fmt: skip
    assert (kind, outcome) == ("rerouted", None)
    assert prepared == [] and llm.requests == []  # no prompt made, no call: home does that
    ((topic, key, _, partition, headers),) = sent
    assert (topic, key, partition) == ("tasks", b"t-2", home)
    assert (REROUTED_FROM_HEADER, f"tasks/{away}/7".encode()) in headers


async def test_a_forward_the_broker_refuses_for_good_is_the_records_dead_letter(
    flow: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record away from home that the task topic takes under its producer's key but not
    under the task id with the forward's header (a record near the topic's limit), or
    that a record policy refuses: its forward stopped the worker, and again on the same
    record after every restart. It is the record's dead letter now, where it stands."""
    run, sent, llm, settings, refuse = flow
    stops: list[BaseException] = []

    async def crash(exc: BaseException) -> None:
        stops.append(exc)

    monkeypatch.setattr(run.writer, "crash", crash)
    refuse.add("tasks")
    home = _home_of("t-2")
    away = (home + 1) % PARTITIONS
    assert await run.run(_record("t-2", away, 7), taken_at=0.0) == "dead_letter"
    ((_, _, _, partition, _), (topic, key, value, where, _)) = sent  # the forward, refused
    assert partition == home and (topic, key, where) == (settings.topics.dead_letters, b"t-2", away)
    letter = orjson.loads(value)
    assert (letter["error"]["category"], letter["error"]["code"]) == ("write_refused",
                                                                      "record_too_large")  # fmt: skip
    assert letter["source"] == {"topic": "tasks", "partition": away, "offset": 7}
    assert stops == [] and llm.requests == []


async def test_a_record_on_a_partition_added_to_the_topic_later_is_forwarded_home(
    flow: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Partitions added to the task topic after the store's topics were made (6 where the
    store keeps 4): no task's home, nothing of theirs stored. Their records waited for a
    store partition that could never load (its topics have no partition 4 or 5), retried
    for good; a bad one's dead letter went to a dead-letter partition that does not
    exist. A task is forwarded to its home among the first 4 and answered there; bad
    input, or a task the topic refuses with its new key, is a dead letter at its home."""
    run, sent, llm, settings, refuse = flow

    async def never(partition: int) -> None:
        raise AssertionError(f"the store was asked for partition {partition}")

    monkeypatch.setattr(run.store, "ready", never)
    extra = PARTITIONS + 1
    assert await run.run(_record("t-9", extra, 3), taken_at=0.0) == "rerouted"
    bad = StoredRecord("tasks", extra, 4, b"a-key", b"{not json", [], None)
    assert await run.run(bad, taken_at=0.0) == "dead_letter"
    (_, key, _, home, headers), (topic, bad_key, value, bad_home, _) = sent
    assert (key, home) == (b"t-9", _home_of("t-9"))
    assert (REROUTED_FROM_HEADER, f"tasks/{extra}/3".encode()) in headers
    dead_letters = settings.topics.dead_letters
    assert (topic, bad_key, bad_home) == (dead_letters, b"a-key", partition_of(b"a-key",
                                                                             PARTITIONS))  # fmt: skip
    letter = orjson.loads(value)
    assert letter["error"]["code"] == "not_json" and letter["source"]["partition"] == extra
    refuse.add("tasks")
    sent.clear()
    assert await run.run(_record("t-9", extra, 5), taken_at=0.0) == "dead_letter"
    assert [(topic, partition) for topic, _, _, partition, _ in sent] == [
        ("tasks", _home_of("t-9")), (dead_letters, _home_of("t-9"))
    ]  # fmt: skip
    assert orjson.loads(sent[-1][2])["error"]["category"] == "write_refused"
    assert llm.requests == []
    # A bug on its way: its internal_error dead letter at its home too (written on the
    # record's own partition, it failed there, and the worker stopped on the record).
    refuse.clear()
    sent.clear()

    def bug(raw: bytes | None) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(run.processor.intake, "route_of", bug)
    assert await run.run(_record("t-9", extra, 6), taken_at=0.0) == "dead_letter"
    ((topic, key, value, partition, _),) = sent
    assert (topic, key, partition) == (dead_letters, b"t-9", _home_of("t-9"))
    assert orjson.loads(value)["error"]["code"] == "internal_error"


async def test_bad_input_is_one_dead_letter_however_often_the_record_runs(flow: Any) -> None:
    run, sent, llm, settings, _ = flow
    bad = StoredRecord("tasks", 1, 3, b"k", b"{not json", [], None)
    source = Source(topic="tasks", partition=1, offset=3)
    kind, outcome = await run.handle(bad, source, Span())
    assert kind == "dead_letter" and outcome is not None and outcome.category == "invalid_input"
    again, _ = await run.handle(bad, source, Span())
    assert again == "already_done"
    assert [s[0] for s in sent] == [settings.topics.dead_letters] and llm.requests == []


@pytest.mark.parametrize(
    ("extra", "code"),
    [({"pipeline": "nope"}, "unknown_pipeline"), ({"input": {"text": 42}}, "slot_type"),
     ({"input": {"body": "hi"}}, "missing_slot"), ({"prompt_version": "v9"}, "unknown_version")],
)  # fmt: skip
async def test_bad_input_away_from_home_ends_where_its_producer_wrote_it(
    flow: Any, extra: dict[str, Any], code: str
) -> None:
    """Not forwarded first and dead-lettered as a copy on another partition: its dead
    letter names the record the producer wrote, written once however often it runs."""
    run, sent, llm, settings, _ = flow
    away = (_home_of("t-3") + 1) % PARTITIONS
    record = _record("t-3", away, 11, **extra)
    source = Source(topic="tasks", partition=away, offset=11)
    kind, outcome = await run.handle(record, source, Span())
    assert kind == "dead_letter" and outcome is not None
    again, _ = await run.handle(record, source, Span())
    assert again == "already_done"
    ((topic, _, value, partition, _),) = sent
    assert (topic, partition) == (settings.topics.dead_letters, away)
    letter = orjson.loads(value)
    assert letter["error"]["code"] == code and letter["source"] == source.model_dump()
    assert llm.requests == []


async def test_a_result_the_broker_refuses_for_good_ends_as_the_tasks_dead_letter(
    flow: Any,
) -> None:
    run, sent, llm, settings, refuse = flow
    refuse.add(settings.topics.results)
    record = _record("t-9", _home_of("t-9"))
    source = Source(topic="tasks", partition=record.partition, offset=0)
    kind, outcome = await run.handle(record, source, Span())
    assert kind == "dead_letter" and outcome is not None and outcome.category == "write_refused"
    topics = [s[0] for s in sent]
    assert topics == [settings.topics.results, settings.topics.dead_letters,
                      state_topic(settings)]  # the dead letter, then its state: nothing else  # fmt: skip
    state = orjson.loads(sent[-1][2])
    assert state["status"] == "dead_lettered"
    again, _ = await run.handle(record, source, Span())  # run again: its dead letter stands
    assert again == "already_done" and len(llm.requests) == 1


async def test_a_sink_record_is_written_after_the_result_and_before_the_tasks_state(
    sink_flow: Any,
) -> None:
    """The state, which says the record was answered, is never ahead of the sink: a run
    killed between them writes the sink record again."""
    run, sent, _llm, settings, _ = sink_flow
    record = _record("t-1", _home_of("t-1"))
    source = Source(topic="tasks", partition=record.partition, offset=0)
    kind, outcome = await run.handle(record, source, Span())
    assert kind == "result" and outcome is not None
    assert [s[0] for s in sent] == [settings.topics.results, SINK, state_topic(settings)]
    _, key, value, partition, headers = sent[1]
    assert key == b"t-1" and partition == partition_of(b"t-1", 3)  # the sink's own count
    enriched = orjson.loads(value)
    assert enriched["text"] == "Great phone, works well."  # the task's input, as it came
    assert enriched["llm"]["output"] == GOOD and enriched["llm"]["result_key"] == outcome.key
    assert (RESULT_KEY_HEADER, outcome.key.encode()) in headers
    again, _ = await run.handle(record, source, Span())
    assert again == "already_done" and len(sent) == 3  # nothing written twice


async def test_a_run_killed_after_its_result_writes_the_sink_record_then_the_state(
    sink_flow: Any,
) -> None:
    run, sent, llm, settings, _ = sink_flow
    record = _record("t-2", _home_of("t-2"))
    source = Source(topic="tasks", partition=record.partition, offset=0)
    await run.handle(record, source, Span())
    result = sent[0]
    # As if the run had been killed once its result was acked: the store holds only that.
    await run.store.put(Kind.TASK_STATES, record.partition, b"t-2", None)
    sent.clear()
    kind, _outcome = await run.handle(record, source, Span())  # the record runs again
    assert kind == "already_done" and len(llm.requests) == 1  # no second call
    assert [s[0] for s in sent] == [SINK, state_topic(settings)]  # the result not again
    assert orjson.loads(sent[0][2])["llm"]["result_key"] == result[1].decode()
    assert orjson.loads(sent[1][2])["status"] == "succeeded"


async def test_a_sink_that_refuses_the_record_for_good_makes_the_tasks_dead_letter(
    sink_flow: Any,
) -> None:
    run, sent, llm, settings, refuse = sink_flow
    refuse.add(SINK)
    record = _record("t-3", _home_of("t-3"))
    source = Source(topic="tasks", partition=record.partition, offset=0)
    kind, outcome = await run.handle(record, source, Span())
    assert kind == "dead_letter" and outcome is not None and outcome.category == "write_refused"
    assert outcome.error is not None and SINK in outcome.error["message"]
    topics = [s[0] for s in sent]
    assert topics == [settings.topics.results, SINK, settings.topics.dead_letters,
                      f"{SINK}.dlq", state_topic(settings)]  # fmt: skip
    assert orjson.loads(sent[-1][2])["status"] == "dead_lettered"
    again, _ = await run.handle(record, source, Span())
    assert again == "already_done" and len(llm.requests) == 1


async def test_bad_input_of_a_pipeline_with_a_sink_is_copied_to_its_dead_letter_topic(
    sink_flow: Any,
) -> None:
    run, sent, llm, settings, refuse = sink_flow
    record = _record("t-4", _home_of("t-4"), input={"text": 42})
    source = Source(topic="tasks", partition=record.partition, offset=0)
    kind, _outcome = await run.handle(record, source, Span())
    assert kind == "dead_letter" and llm.requests == []
    assert [s[0] for s in sent] == [settings.topics.dead_letters, f"{SINK}.dlq"]
    assert sent[0][2] == sent[1][2] and sent[1][1] == b"t-4"
    refuse.add(f"{SINK}.dlq")  # a copy refused for good is left out, the letter stands
    other = _record("t-5", _home_of("t-5"), input={"text": 42})
    kind, _ = await run.handle(other, Source(topic="tasks", partition=other.partition,
                                             offset=1), Span())  # fmt: skip
    assert kind == "dead_letter" and sent[-2][0] == settings.topics.dead_letters


async def test_an_erase_request_leaves_tombstones_where_the_task_was_written(
    sink_flow: Any,
) -> None:
    """Its results under every result key its state knows (and their review copies), its
    dead letter, its sink record and its dead letter's copy, then its state: the answers
    quote the comment, so a deletion upstream must reach all of them."""
    run, sent, llm, settings, _ = sink_flow
    record = _record("t-7", _home_of("t-7"))
    source = Source(topic="tasks", partition=record.partition, offset=0)
    _, outcome = await run.handle(record, source, Span())
    assert outcome is not None and run.store.result(record.partition, outcome.key) is not None
    sent.clear()
    request = EraseRequest(task_id="t-7", pipeline="comment-analysis")
    erase = StoredRecord("tasks", record.partition, 1, b"t-7", request.model_dump_json().encode(),
                         [(ERASE_HEADER, b"command")], None)  # fmt: skip
    kind, nothing = await run.handle(erase, Source(topic="tasks", partition=record.partition,
                                                   offset=1), Span())  # fmt: skip
    assert (kind, nothing) == ("erased", None)
    written = [(topic, key, value) for topic, key, value, _, _ in sent]
    # First, the ledger's mark: a batch-lane job of the task parked before does not answer.
    assert written.pop(0)[:2] == (ledger_topic(settings), b"erased/t-7")
    assert written == [
        (settings.topics.results, outcome.key.encode(), None),
        (settings.topics.review, outcome.key.encode(), None),
        (settings.topics.dead_letters, b"t-7", None),
        (SINK, b"t-7", None),
        (f"{SINK}.dlq", b"t-7", None),
        (state_topic(settings), b"t-7", None),  # last: a run killed before erases again
    ]
    assert run.store.result(record.partition, outcome.key) is None
    assert run.store.state(record.partition, "t-7") is None
    assert run.metrics.erasures.labels("comment-analysis", "command")._value.get() == 1
    assert len(llm.requests) == 1  # nothing asked
    # One for a pipeline this worker does not know (gone from its config, or a name
    # made up): erased all the same, counted under one label for every such name.
    for n, name in enumerate(["retired-pipeline", "made-up-1", "made-up-2"], 2):
        unknown = EraseRequest(task_id="t-7", pipeline=name).model_dump_json().encode()
        erase = StoredRecord("tasks", record.partition, n, b"t-7", unknown,
                             [(ERASE_HEADER, b"command")], None)  # fmt: skip
        kind, _ = await run.handle(erase, Source(topic="tasks", partition=record.partition,
                                                 offset=n), Span())  # fmt: skip
        assert kind == "erased"
    assert run.metrics.erasures.labels("unknown", "command")._value.get() == 3
    assert {sample.labels["pipeline"] for m in run.metrics.registry.collect()
            if m.name == "llm_streams_erasures" for sample in m.samples} == {
        "comment-analysis", "unknown"}  # fmt: skip
    # Its record read again — a replay sent before the erasure, a batch-lane job parked
    # when it came, a group read from the start — is not answered: it would write back
    # what the erasure took away (before: answered, result and sink record written again).
    sent.clear()
    invalid = orjson.dumps({"task_id": "t-7", "pipeline": "comment-analysis", "input": {}})
    for old in (
        record,
        replace(record, topic="tasks-replay", timestamp=time.time() - 60),
        replace(record, value=invalid),
    ):  # nor dead-lettered: it would carry it again
        kind, _ = await run.handle(old, source, Span())
        assert kind == "erased" and sent == [] and len(llm.requests) == 1
    sent_again = replace(record, offset=9, timestamp=time.time() + 1)
    again, _ = await run.handle(sent_again, Source(topic="tasks", partition=record.partition,
                                                   offset=9), Span())  # fmt: skip
    assert again == "result" and len(llm.requests) == 2  # sent again: asked, nothing kept


async def test_an_erasure_a_sink_refuses_for_good_is_a_dead_letter_the_rest_erased(
    sink_flow: Any,
) -> None:
    """A sink topic this worker may no longer write (its ACL revoked) stopped the worker —
    and again on the same request after every restart. The other tombstones are written,
    the state kept (sent again, the request erases what is left), and the request is its
    own dead letter saying what was refused."""
    run, sent, _, settings, refuse = sink_flow
    record = _record("t-9", _home_of("t-9"))
    _, outcome = await run.handle(record, Source(topic="tasks", partition=record.partition,
                                                 offset=0), Span())  # fmt: skip
    assert outcome is not None
    sent.clear()
    refuse.add(SINK)
    value = EraseRequest(task_id="t-9", pipeline="comment-analysis").model_dump_json().encode()
    erase = StoredRecord("tasks", record.partition, 1, b"t-9", value,
                         [(ERASE_HEADER, b"command")], None)  # fmt: skip
    kind, letter = await run.handle(erase, Source(topic="tasks", partition=record.partition,
                                                  offset=1), Span())  # fmt: skip
    assert kind == "dead_letter" and letter is not None and letter.error is not None
    assert letter.category == "write_refused" and letter.error["code"] == "record_too_large"
    assert f"{SINK} refused the erasure of the {SINK} record of t-9" in letter.error["message"]
    written = [(topic, key, value) for topic, key, value, _, _ in sent]
    assert (settings.topics.results, outcome.key.encode(), None) in written
    assert (f"{SINK}.dlq", b"t-9", None) in written  # the rest went on
    assert (state_topic(settings), b"t-9", None) not in written
    assert run.store.result(record.partition, outcome.key) is None
    assert run.store.state(record.partition, "t-9") is not None  # kept: sent again, ...
    refuse.clear()
    again = replace(erase, offset=2)
    kind, _ = await run.handle(again, Source(topic="tasks", partition=record.partition,
                                             offset=2), Span())  # fmt: skip
    assert kind == "erased" and run.store.state(record.partition, "t-9") is None  # ... done


async def test_an_erase_request_away_from_its_task_is_forwarded_and_a_bad_one_dead_lettered(
    sink_flow: Any,
) -> None:
    run, sent, _, _, _ = sink_flow
    home = _home_of("t-8")
    away = (home + 1) % PARTITIONS
    value = EraseRequest(task_id="t-8", pipeline="comment-analysis").model_dump_json().encode()
    erase = StoredRecord("tasks", away, 4, b"x", value, [(ERASE_HEADER, b"source")], None)
    kind, _ = await run.handle(erase, Source(topic="tasks", partition=away, offset=4), Span())
    assert kind == "rerouted"
    ((topic, key, forwarded, partition, headers),) = sent
    assert (topic, key, forwarded, partition) == ("tasks", b"t-8", value, home)
    assert (ERASE_HEADER, b"source") in headers  # still an erase request there
    bad = StoredRecord("tasks", away, 5, b"x", b'{"task_id": 1}', [(ERASE_HEADER, b"source")],
                       None)  # fmt: skip
    kind, letter = await run.handle(bad, Source(topic="tasks", partition=away, offset=5), Span())
    assert kind == "dead_letter" and letter is not None and letter.error is not None
    assert letter.error["code"] == "bad_erase_request"


async def test_a_replayed_or_restored_answer_is_written_to_the_sink_under_the_same_key(
    sink_flow: Any,
) -> None:
    """A compacted sink stays one record per task: a replay asked again (`--force`) and a
    backtrack's restore write the answer again under the task's key."""
    run, sent, llm, _, _ = sink_flow
    record = _record("t-6", _home_of("t-6"))
    await run.handle(record, Source(topic="tasks", partition=record.partition, offset=0), Span())
    replayed = StoredRecord("tasks", record.partition, 1, b"t-6", record.value,
                            [(FORCE_HEADER, b"1")], None)  # fmt: skip
    kind, _ = await run.handle(replayed, Source(topic="tasks", partition=record.partition,
                                                offset=1), Span())  # fmt: skip
    assert kind == "result" and len(llm.requests) == 2  # asked again
    restored = StoredRecord("tasks", record.partition, 2, b"t-6", record.value,
                            [(BACKTRACK_HEADER, b"restore")], None)  # fmt: skip
    kind, _ = await run.handle(restored, Source(topic="tasks", partition=record.partition,
                                                offset=2), Span())  # fmt: skip
    assert kind == "result" and len(llm.requests) == 2  # from the store: no call
    keys = [key for topic, key, *_ in sent if topic == SINK]
    assert keys == [b"t-6"] * 3


async def test_an_erased_turn_leaves_its_session_and_the_last_one_the_session_itself(
    session_flow: Any,
) -> None:
    run, *_ = session_flow
    home = _home_of("s-1")  # a session's tasks live on its partition
    for offset, task_id in enumerate(("s-1-a", "s-1-b")):
        record = _record(task_id, home, offset, session_id="s-1")
        record = StoredRecord("tasks", home, offset, b"s-1", record.value, [], None)
        kind, _ = await run.handle(record, Source(topic="tasks", partition=home,
                                                  offset=offset), Span())  # fmt: skip
        assert kind == "result"
    turns = run.store.get(Kind.SESSIONS, home, b"s-1")
    assert [t["task_id"] for t in orjson.loads(turns)["turns"]] == ["s-1-a", "s-1-b"]
    for offset, task_id in ((5, "s-1-a"), (6, "s-1-b")):
        request = EraseRequest(task_id=task_id, pipeline="comment-analysis", session_id="s-1")
        erase = StoredRecord("tasks", home, offset, b"s-1", request.model_dump_json().encode(),
                             [(ERASE_HEADER, b"command")], None)  # fmt: skip
        kind, _ = await run.handle(erase, Source(topic="tasks", partition=home, offset=offset),
                                   Span())  # fmt: skip
        assert kind == "erased"
        assert run.store.state(home, task_id) is None
        if task_id == "s-1-a":
            left = run.store.get(Kind.SESSIONS, home, b"s-1")
            assert [t["task_id"] for t in orjson.loads(left)["turns"]] == ["s-1-b"]
    assert run.store.get(Kind.SESSIONS, home, b"s-1") is None  # no turn left: the entry goes


async def test_a_bug_on_a_records_way_ends_as_one_internal_error_dead_letter(
    flow: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, sent, llm, settings, _ = flow

    def broken(*_: Any, **__: Any) -> Any:
        raise KeyError("a bug")

    monkeypatch.setattr(run.decider, "decide", broken)
    record = _record("t-bug", _home_of("t-bug"))
    assert await run.run(record, taken_at=0.0) == "dead_letter"
    letters = [orjson.loads(s[2]) for s in sent if s[0] == settings.topics.dead_letters]
    assert [(d["task_id"], d["error"]["code"]) for d in letters] == [("t-bug", "internal_error")]
    assert letters[0]["error"]["retryable"] is False and llm.requests == []


async def test_a_record_of_a_partition_given_away_is_released_unanswered(flow: Any) -> None:
    run, sent, llm, _, _ = flow
    home = _home_of("t-away")
    run.store.assign(set(range(PARTITIONS)) - {home})  # the rebalance took its partition
    assert await run.run(_record("t-away", home), taken_at=0.0) == "released"
    assert sent == [] and llm.requests == []


async def _damaged(run: Any, home: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read of partition `home`'s local copy meets a block that fails its checksum."""
    await run.store.ready(home)

    def broken(*_: Any) -> Any:
        raise Exception("Corruption: block checksum mismatch")

    monkeypatch.setattr(run.store._parts[home].maps, "get", broken)


async def test_a_record_whose_partitions_store_is_found_damaged_is_released_unanswered(
    flow: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its decide reads a block of the local copy that fails its checksum: the store drops
    the partition (the worker starts it again) and the record runs again then — it is no
    bug of the worker, and no dead letter is written for it."""
    run, sent, llm, _, _ = flow
    home = _home_of("t-damaged")
    await _damaged(run, home, monkeypatch)
    assert await run.run(_record("t-damaged", home), taken_at=0.0) == "released"
    assert sent == [] and llm.requests == [] and home not in run.store.owned()


async def test_a_session_turn_read_from_a_damaged_store_is_released_unanswered(
    session_flow: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read of its session's earlier turns, in its prepare, meets the damage: no
    `internal_error` dead letter (prepare's catch-all for bugs lets it through)."""
    run, sent, llm, _, _ = session_flow
    home = _home_of("s-9")
    await _damaged(run, home, monkeypatch)
    record = _record("s-9-a", home, session_id="s-9")
    assert await run.run(record, taken_at=0.0) == "released"
    assert sent == [] and llm.requests == []


def _forwarded(task_id: str, offset: int, origin: bytes) -> StoredRecord:
    """A task as the sources agent forwards it: its source record in a header."""
    record = _record(task_id, _home_of(task_id), offset)
    return replace(record, headers=[(SOURCE_OF_HEADER, origin)])


async def test_a_source_record_forwarded_twice_is_answered_and_written_to_its_sink_once(
    sink_flow: Any,
) -> None:
    """Its forwarder died before the source offset committed, so the same source record
    came twice (at two offsets of llm-tasks): the second finds the first's answer."""
    run, sent, llm, _settings, _ = sink_flow
    first = _forwarded("t-src", 4, b"shop.reviews/2/17")
    kind, _ = await run.handle(first, Source(topic="tasks", partition=first.partition,
                                             offset=4), Span())  # fmt: skip
    assert kind == "result" and [s[0] for s in sent].count(SINK) == 1
    state = orjson.loads(sent[-1][2])
    assert state["history"][-1]["origin"] == "shop.reviews/2/17"
    sent.clear()
    again = _forwarded("t-src", 9, b"shop.reviews/2/17")
    kind, outcome = await run.handle(again, Source(topic="tasks", partition=again.partition,
                                                   offset=9), Span())  # fmt: skip
    assert (kind, outcome) == ("already_done", None) and sent == [] and len(llm.requests) == 1
    # Another source record of the same task is a record of its own: answered (from the
    # store, no call) and written again, as a task published twice is.
    other = _forwarded("t-src", 12, b"shop.reviews/2/30")
    kind, _ = await run.handle(other, Source(topic="tasks", partition=other.partition,
                                             offset=12), Span())  # fmt: skip
    assert kind == "result" and SINK in [s[0] for s in sent] and len(llm.requests) == 1


def _sent_by(task_id: str, offset: int, run: bytes, copied: bytes, *more: Any) -> StoredRecord:
    """A task as a replay or a backtrack sends it into the replay lane."""
    record = replace(_record(task_id, _home_of(task_id), offset), topic="llm-tasks-replay")
    return replace(record, headers=[(REPLAY_ID_HEADER, run), (REPLAY_OF_HEADER, copied), *more])


async def _handled(run: Any, record: StoredRecord) -> tuple[str, Any]:
    source = Source(topic=record.topic, partition=record.partition, offset=record.offset)
    return await run.handle(record, source, Span())


@pytest.mark.parametrize("how", [(FORCE_HEADER, b"1"), (BACKTRACK_HEADER, b"rerun")])
async def test_a_forced_copy_a_killed_command_sent_again_is_not_asked_again(
    flow: Any, how: tuple[str, bytes]
) -> None:
    """A forced replay (or a backtrack re-run) killed after sending, before its checkpoint,
    and run again sends the same records again: the first copy paid for the answer, the
    second ends nothing again. Another record of the same run is still answered."""
    run, sent, llm, _, _ = flow
    first = _sent_by("t-run", 3, b"rp-1", b"llm-tasks/0/17", how)
    assert (await _handled(run, first))[0] == "result" and len(llm.requests) == 1
    state = orjson.loads(sent[-1][2])
    assert state["history"][-1]["run"] == "rp-1@llm-tasks/0/17"
    sent.clear()
    again = _sent_by("t-run", 8, b"rp-1", b"llm-tasks/0/17", how)
    assert await _handled(run, again) == ("already_done", None)
    assert sent == [] and len(llm.requests) == 1
    # The same task's other record in the range: a copy of its own, asked again.
    other = _sent_by("t-run", 9, b"rp-1", b"llm-tasks/0/40", how)
    assert (await _handled(run, other))[0] == "result" and len(llm.requests) == 2
    # The first record's copy sent a third time, after the newer one: it does not put
    # the older answer back over the newer.
    sent.clear()
    assert await _handled(run, _sent_by("t-run", 12, b"rp-1", b"llm-tasks/0/17", how)) == (
        "already_done", None)  # fmt: skip
    assert sent == [] and len(llm.requests) == 2
    # A run said in headers over what a history keeps: kept as their digest.
    long = _sent_by("t-run", 14, b"x" * 2_000, b"llm-tasks/0/17", how)
    assert (await _handled(run, long))[0] == "result"
    assert orjson.loads(sent[-1][2])["history"][-1]["run"].startswith("sha256:")
    assert len(sent[-1][2]) < 4_000
    assert await _handled(run, replace(long, offset=15)) == ("already_done", None)
    # Another run (another replay's id) of the same record is asked again.
    other_run = _sent_by("t-run", 13, b"rp-2", b"llm-tasks/0/17", how)
    assert (await _handled(run, other_run))[0] == "result"
    assert len(llm.requests) == 4  # the long run's, then this one


@pytest.mark.parametrize("error", [TypeError("an integer is required on field stars"),
                                   decimal.InvalidOperation("a decimal column of 'n/a'")])  # fmt: skip
async def test_a_sink_record_its_registered_schema_cannot_hold_makes_the_tasks_dead_letter(
    sink_flow: Any, error: Exception
) -> None:
    """The sink's framing (its schema in the registry) refuses the record: no retry mends
    that, so the task ends as a dead letter saying so, and the worker goes on."""
    run, sent, _llm, _settings, _ = sink_flow

    def framing(value: bytes) -> bytes:
        raise error

    run.writer.limits = replace(run.writer.limits, framing={SINK: framing})
    record = _record("t-frame", _home_of("t-frame"))
    source = Source(topic="tasks", partition=record.partition, offset=0)
    kind, outcome = await run.handle(record, source, Span())
    assert kind == "dead_letter" and outcome is not None and outcome.category == "write_refused"
    assert outcome.error is not None and outcome.error["code"] == "unencodable"
    assert "registered schema cannot hold" in outcome.error["message"]
    assert SINK not in [s[0] for s in sent]  # nothing half-written there
    assert orjson.loads(sent[-1][2])["status"] == "dead_lettered"


_HEADER_NAMES = st.sampled_from([ERASE_HEADER, FORCE_HEADER, BACKTRACK_HEADER, TIER_HEADER,
                                 REPLAY_ID_HEADER, REPLAY_OF_HEADER, REROUTED_FROM_HEADER, SOURCE_OF_HEADER,
                                 RESULT_KEY_HEADER, "x-other"])  # fmt: skip
_HEADER_VALUES = st.sampled_from([b"1", b"rerun", b"restore", b"batch", b"flex", b"sync",
                                  b"tasks/0/x", b"tasks/1/-3", b"a/b", b"\xff\xfe", b""]) | st.binary(
    max_size=24
)  # fmt: skip
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))  # fmt: skip
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)  # fmt: skip
_IDS = st.sampled_from(["t-1", "t-2", "s-1"])
_ID = _IDS | st.text(max_size=8) | st.text(min_size=500, max_size=600) | _JSON
_GOOD_TASK = st.fixed_dictionaries(
    {"task_id": _IDS, "pipeline": st.just("comment-analysis"),
     "input": st.fixed_dictionaries({"text": st.sampled_from(["Great phone.", "Bad."])})},
    optional={"session_id": _IDS, "prompt_version": st.just("v1")},
)  # fmt: skip
_BAD_TASK = st.fixed_dictionaries(
    {"task_id": _ID, "pipeline": st.sampled_from(["comment-analysis", "reply-draft", "nope"]) | _JSON},
    optional={"input": st.fixed_dictionaries({"text": st.text(max_size=40) | _JSON}) | _JSON,
              "session_id": _ID, "prompt_version": st.sampled_from(["v1", "v9"]) | _JSON,
              "metadata": _JSON, "source_key": _JSON, "source_record": _JSON, "extra": _JSON},
)  # fmt: skip
_VALUE = (
    (_GOOD_TASK | _BAD_TASK).map(orjson.dumps) | _JSON.map(orjson.dumps) | st.binary(max_size=64)
)
_KEY = st.none() | st.sampled_from([b"t-1", b"t-2", b"s-1"]) | st.binary(max_size=16)


@settings(max_examples=150, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(records=st.lists(st.tuples(_KEY, _VALUE, st.lists(st.tuples(_HEADER_NAMES, _HEADER_VALUES),
                                                         max_size=3), st.integers(0, PARTITIONS - 1)),
                        min_size=1, max_size=3))  # fmt: skip
def test_whatever_a_producer_writes_the_record_ends_never_as_a_bug_of_the_worker(
    make_processor: MakeProcessor,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    records: list[tuple[bytes | None, bytes, list[tuple[str, bytes]], int]],
) -> None:
    """Records of any key, value and headers (garbled task fields, erase requests, backtrack,
    tier, replay and source headers of any bytes), on any partition, through the whole way
    of a pipeline keeping sessions and writing a sink: each ends — answered, forwarded home,
    a dead letter saying why — and none as `internal_error` or an exception."""
    registry = _registry(tmp_path, sink=True, session=True)

    async def go() -> None:
        async with _flow(make_processor, monkeypatch, registry) as (run, sent, llm, settings, _r):
            outcomes = {settings.topics.results, settings.topics.dead_letters, SINK,
                        f"{SINK}.dlq"}  # fmt: skip
            for offset, (key, value, headers, partition) in enumerate(records):
                record = StoredRecord("tasks", partition, offset, key, value, headers, None)
                kind = await run.run(record, taken_at=0.0)
                asked, written = len(llm.requests), len(sent)
                again = await run.run(record, taken_at=0.0)  # delivered again: ends once
                assert len(llm.requests) == asked, (records, kind, again)
                twice = [s for s in sent[written:] if s[0] in outcomes]
                assert twice == [] and again in (kind, Ended.ALREADY_DONE), (kind, again, twice)
                assert kind not in (Ended.PARKED, Ended.RELEASED), kind
            letters = [orjson.loads(s[2]) for s in sent
                       if s[0] == settings.topics.dead_letters and s[2] is not None]  # fmt: skip
            bugs = [d["error"] for d in letters if d["error"]["category"] == "internal_error"]
            assert bugs == [], (records, bugs)

    asyncio.run(go())
