"""Pipelines' sinks on real Kafka: a source topic's records come back in a topic of the
user's, enriched with their answer and keyed as they were; a pipeline's dead letters get
a copy of their own; with exactly-once, a SIGKILL mid-run leaves one sink record per
task to a read_committed reader, from a source topic too; a delete upstream, or `llm-streams erase`, leaves no
live record of a task in the sink, the results or the task store."""

from __future__ import annotations

import asyncio
import io
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import fastavro
import orjson
import pytest
from aiokafka.admin import NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from streams.contract.headers import RESULT_KEY_HEADER, SOURCE_OF_HEADER
from streams.dev.simulator import SimulatorServer
from streams.kafka import clients
from streams.kafka.topics import ensure_topics
from streams.settings import Settings
from tests.integration.helpers import (
    WorkerProcess,
    collect,
    produce,
    ready_within,
    register_schema,
    registry_framed,
    run_cli,
)
from tests.integration.test_sources import ENVELOPE, KEY, _publish

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


async def _read(settings: Settings, topic: str, *, committed: bool = False) -> list[Any]:
    """Every record of `topic` now, as a plain consumer of the user's reads it."""
    consumer = clients.consumer(
        settings, topic, purpose="sink-reader", group_id=f"sink-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest", enable_auto_commit=False,
        isolation_level="read_committed" if committed else "read_uncommitted",
    )  # fmt: skip
    await consumer.start()
    try:
        records: list[Any] = []
        while True:
            batch = await consumer.getmany(timeout_ms=1000)
            if not batch:
                return records
            for part in batch.values():
                records += part
    finally:
        await consumer.stop()


async def _wait_for(settings: Settings, topic: str, n: int, worker: WorkerProcess,
                    *, committed: bool = False, timeout_s: float = 180) -> list[Any]:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert worker.alive(), worker.log_tail()
        records = await _read(settings, topic, committed=committed)
        if len({r.key for r in records}) >= n:
            return records
        await asyncio.sleep(1)
    raise AssertionError(f"{topic}: fewer than {n} keys in time:\n{worker.log_tail()}")


def _example_into_sink(tmp_path: Path, example: str, topic: str, source: str, sink: str) -> Path:
    """The shipped pipelines and `examples/sources/<example>.yaml` reading `source` (for its
    `topic`), with `sink:` (YAML lines) appended; the pipelines folder."""
    pipelines = tmp_path / "pipelines"
    shutil.copytree(ROOT / "pipelines", pipelines)
    text = (ROOT / "examples" / "sources" / f"{example}.yaml").read_text()
    (pipelines / f"{example}.yaml").write_text(
        text.replace(f"[{topic}]", f"[{source}]") + "sink:\n" + sink)  # fmt: skip
    return pipelines


async def _user_topic(settings: Settings, topic: str) -> None:
    """The user's topic, with its own partition count (the sink is left to the worker)."""
    admin = clients.admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    finally:
        await admin.close()


async def test_a_source_topic_comes_back_enriched_in_a_sink_keyed_as_it_was(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:8]
    source, sink, dlq = f"app.comments-{suffix}", f"app.comments.analysed-{suffix}", f"dlq-{suffix}"
    pipelines = _example_into_sink(
        tmp_path, "plain-comments", "app.comments", source,
        f"  topic: {sink}\n  key: source_key\n  field: analysis\n  headers: [origin, sid]\n"
        f"  dead_letters: {dlq}\n",
    )  # fmt: skip
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1"}, pipelines_dir=pipelines)  # fmt: skip
    await ensure_topics(settings)
    await _user_topic(settings, source)
    # Text keys, and keys as Java's LongSerializer writes them (254 and 255 were one task
    # id when keys were read with replacement characters).
    keys = [f"c-{i}".encode() for i in range(20)]
    keys += [n.to_bytes(8, "big") for n in (254, 255, 1 << 63 | 1, 0xFFFF)]
    comments = {key: {"comment": {"text": f"Love it, number {i}!"}, "shop": "s1"}
                for i, key in enumerate(keys)}  # fmt: skip
    sid = bytes(range(0x80, 0x90))  # a binary header (Confluent's schema id: a GUID)
    producer = clients.producer(settings, acks="all")
    await producer.start()
    try:
        for key, value in comments.items():
            await producer.send_and_wait(source, key=key, value=orjson.dumps(value),
                                         headers=[("origin", b"eu"), ("sid", sid),
                                                  ("x", b"no")])  # fmt: skip
        await producer.send_and_wait(source, key=b"c-bad", value=b'{"comment": {}}')
    finally:
        await producer.stop()
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await ready_within(worker, 90)  # its sink made (a reader before would auto-create it)
        records = await _wait_for(settings, sink, len(comments), worker)
        copies = await _wait_for(settings, dlq, 1, worker)
        await asyncio.sleep(2)  # anything written twice would show by now
        records = await _read(settings, sink)
    finally:
        worker.stop()

    assert sorted(r.key for r in records) == sorted(comments)  # once each, keyed as read
    for record in records:
        value = orjson.loads(record.value)
        original = comments[record.key]
        assert {k: value[k] for k in original} == original  # the user's record as it was
        assert value["analysis"]["output"]["sentiment"] and value["analysis"]["model"]
        headers = dict(record.headers)
        assert headers["origin"] == b"eu" and "x" not in headers  # carried by name
        assert headers["sid"] == sid  # as read
        assert headers[RESULT_KEY_HEADER].decode() == value["analysis"]["result_key"]
        assert headers[SOURCE_OF_HEADER].decode().startswith(f"{source}/")
    (copy,) = copies
    assert copy.key == b"c-bad" and orjson.loads(copy.value)["error"]["code"] == "source_pointer"
    results = await collect(settings, set(), timeout_s=30, settle_s=0.5,
                            until=lambda g: len(g.results) >= len(comments))  # fmt: skip
    assert len(results.results) == len(comments)  # the envelopes stay in llm-results
    admin = clients.admin(settings)
    await admin.start()
    try:  # made at start, compacted, with the task topics' partition count
        (described,) = await admin.describe_topics([sink])
        (configs,) = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, sink, {"cleanup.policy": None})]
        )
    finally:
        await admin.close()
    assert len(described["partitions"]) == settings.kafka.partitions
    policy = {entry[0]: entry[1] for entry in configs.resources[0][4]}["cleanup.policy"]
    assert policy == "compact"


async def test_with_exactly_once_a_kill_mid_run_leaves_one_sink_record_per_task(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 200, "fixed"
    pipelines = tmp_path / "pipelines"
    shutil.copytree(ROOT / "pipelines", pipelines)
    sink = f"comments.answers-{uuid.uuid4().hex[:8]}"
    path = pipelines / "comment-analysis.yaml"
    path.write_text(path.read_text() + f"sink:\n  topic: {sink}\n  shape: output\n")
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        batch={"size": 50, "concurrency": 16}, pipelines_dir=pipelines,
        kafka={"session_timeout_s": 6, "commit_interval_s": 0.5},
        processing_guarantee="exactly_once",
    )  # fmt: skip
    n = 600
    tasks = [{"task_id": f"s-{i:04d}", "pipeline": "comment-analysis",
              "input": {"text": f"Comment {i}: fine kettle, loud lid."}} for i in range(n)]  # fmt: skip
    await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
    first = WorkerProcess(settings, tmp_path / "first.log").start()
    try:
        deadline, done = time.monotonic() + 120, 0.0
        while time.monotonic() < deadline and done < 100:  # killed mid-run
            assert first.alive(), first.log_tail()
            try:
                done = (await first.scrape()).value("llm_streams_tasks_completed_total")
            except OSError:  # not listening yet
                done = 0
            await asyncio.sleep(0.2)
        first.kill()
        assert 100 <= done < n  # tasks answered and written, most not yet
    finally:
        first.stop()
    second = WorkerProcess(settings, tmp_path / "second.log").start()
    try:
        records = await _wait_for(settings, sink, n, second, committed=True, timeout_s=240)
        await asyncio.sleep(3)
        records = await _read(settings, sink, committed=True)
    finally:
        second.stop()
    keys = [r.key.decode() for r in records]
    assert sorted(keys) == sorted(t["task_id"] for t in tasks)  # each once, read committed
    assert all(orjson.loads(r.value)["sentiment"] for r in records)  # the answer alone


async def test_with_exactly_once_a_source_killed_while_it_forwards_leaves_one_answer_each(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    """Exactly-once with a source topic: two SIGKILLs while its records are forwarded
    (each forwards again what its offsets had not committed), and a read_committed reader
    of the sink and of llm-results finds every source record answered exactly once."""
    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 50, "fixed"
    suffix = uuid.uuid4().hex[:8]
    source, sink = f"app.comments-{suffix}", f"app.comments.answers-{suffix}"
    pipelines = _example_into_sink(tmp_path, "plain-comments", "app.comments", source,
                                   f"  topic: {sink}\n  shape: output\n  key: source_key\n")  # fmt: skip
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        batch={"size": 50, "concurrency": 16}, pipelines_dir=pipelines,
        # Offsets (the source's, and the transactions) every 2 s: a kill forwards again
        # up to 2 s of source records.
        kafka={"session_timeout_s": 6, "commit_interval_s": 2.0},
        processing_guarantee="exactly_once",
    )  # fmt: skip
    await ensure_topics(settings)
    await _user_topic(settings, source)
    n = 600
    keys = [f"c-{i:04d}" for i in range(n)]

    async def publish() -> None:  # while the workers run: ~40 records a second
        producer = clients.producer(settings, acks="all")
        await producer.start()
        try:
            for i, key in enumerate(keys):
                value = {"comment": {"text": f"Comment {i}: fine kettle, loud lid."}}
                await producer.send_and_wait(source, key=key.encode(), value=orjson.dumps(value))
                await asyncio.sleep(0.025)
        finally:
            await producer.stop()

    publishing: asyncio.Task[None] | None = None
    for run in range(2):  # killed mid-run, twice
        worker = WorkerProcess(settings, tmp_path / f"run{run}.log").start()
        try:
            await ready_within(worker, 90)
            if publishing is None:
                publishing = asyncio.create_task(publish())
            await asyncio.sleep(4)  # forwarding and answering
            assert worker.alive(), worker.log_tail()
            worker.kill()
        finally:
            worker.stop()
    last = WorkerProcess(settings, tmp_path / "last.log").start()
    try:
        assert publishing is not None
        await publishing
        await _wait_for(settings, sink, n, last, committed=True, timeout_s=240)
        await asyncio.sleep(3)  # anything written twice would show by now
        records = await _read(settings, sink, committed=True)
        results = await _read(settings, settings.topics.results, committed=True)
    finally:
        last.stop()
    twice = [k for k, c in Counter(r.key for r in records).items() if c > 1]
    assert sorted(r.key.decode() for r in records) == keys, twice  # each exactly once
    assert all(orjson.loads(r.value)["sentiment"] for r in records)
    answered = [orjson.loads(r.value)["task_id"] for r in results if r.value is not None]
    assert sorted(answered) == keys  # one envelope each in llm-results too


async def test_a_debezium_avro_source_comes_back_enriched_in_avro_under_its_own_schema(
    make_settings: Any, simulator: SimulatorServer, schema_registry: str, tmp_path: Path
) -> None:
    """A Debezium change stream in Avro through the registry, written back enriched in
    Avro: the source's own schema with the answer added, registered under the sink's
    subject; a plain consumer reads each record with the schema its id names."""
    suffix = uuid.uuid4().hex[:8]
    source, sink = f"shop.reviews.avro-{suffix}", f"shop.reviews.analysed-{suffix}"
    pipelines = _example_into_sink(
        tmp_path, "reviews-avro", "shop.public.reviews.avro", source,
        f"  topic: {sink}\n  key: source_key\n  format: avro\n  fields: {{sentiment: /sentiment}}\n",
    )  # fmt: skip
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1"}, pipelines_dir=pipelines,
                             schema_registry={"url": schema_registry})  # fmt: skip
    await ensure_topics(settings)
    key_id = await register_schema(schema_registry, f"{source}-key", KEY)
    value_id = await register_schema(schema_registry, f"{source}-value", ENVELOPE)
    rows = {i: {"id": i, "body": f"The strap broke after {i} weeks.", "product_name": "Bag",
                "stars": 1 + i % 5} for i in range(1, 9)}  # fmt: skip
    records = [(registry_framed(key_id, KEY, {"id": i}),
                registry_framed(value_id, ENVELOPE, {"before": None, "after": row, "op": "c",
                                                     "ts_ms": 1_764_500_000_000 + i}))
               for i, row in rows.items()]  # fmt: skip
    await _publish(settings, source, records)  # the user's topic, there before the worker
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await ready_within(worker, 90)  # its sink made (a reader before would auto-create it)
        written = await _wait_for(settings, sink, len(rows), worker)
    finally:
        worker.stop()
    assert len(written) == len(rows)
    async with aiohttp.ClientSession() as session:
        schemas: dict[int, Any] = {}
        for record in written:
            assert record.value[:1] == b"\x00"
            schema_id = int.from_bytes(record.value[1:5], "big")
            if schema_id not in schemas:
                async with session.get(f"{schema_registry}/schemas/ids/{schema_id}") as reply:
                    schemas[schema_id] = fastavro.parse_schema(
                        orjson.loads((await reply.json())["schema"]))  # fmt: skip
            value = fastavro.schemaless_reader(io.BytesIO(record.value[5:]), schemas[schema_id])
            key = orjson.loads(record.key)  # the source record's decoded key, as JSON
            assert value["after"] == rows[key["id"]] and value["op"] == "c"  # as it was
            assert value["sentiment"] in ("positive", "negative", "neutral", "mixed")
            assert value["llm"]["prompt_version"] == "v1" and value["llm"]["result_key"]
    (schema,) = schemas.values()
    assert schema["name"] == "shop.public.reviews.Envelope"  # the source's record, extended


async def _latest(settings: Settings, topic: str) -> dict[bytes, bytes | None]:
    """The latest value per key: what compaction keeps (None: a tombstone, removed)."""
    return {r.key: r.value for r in await _read(settings, topic)}


async def test_deletes_upstream_and_by_hand_erase_the_answers_wherever_they_were_written(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    """A Debezium delete of an analysed review, and `llm-streams erase` for another: no
    live record of either in the sink, in llm-results or in the task store; the others
    stay."""
    suffix = uuid.uuid4().hex[:8]
    source, sink = f"shop.public.reviews-{suffix}", f"shop.reviews.analysed-{suffix}"
    pipelines = _example_into_sink(tmp_path, "reviews-cdc", "shop.public.reviews", source,
                                   f"  topic: {sink}\n  key: source_key\n")  # fmt: skip
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1"}, pipelines_dir=pipelines)  # fmt: skip
    await ensure_topics(settings)
    await _user_topic(settings, source)

    def change(op: str, i: int) -> bytes:
        row = {"id": i, "body": f"Review {i}: the strap broke after a week.",
               "product_name": "Bag", "stars": 1}  # fmt: skip
        before, after = (row, None) if op == "d" else (None, row)
        return orjson.dumps({"schema": {}, "payload": {"op": op, "before": before,
                                                       "after": after}})  # fmt: skip

    producer = clients.producer(settings, acks="all")
    await producer.start()
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await ready_within(worker, 90)
        for i in range(10):
            await producer.send_and_wait(source, key=orjson.dumps({"id": i}), value=change("c", i))
        await _wait_for(settings, sink, 10, worker)
        for i in range(4):  # deleted upstream: a delete event, then Debezium's tombstone
            await producer.send_and_wait(source, key=orjson.dumps({"id": i}), value=change("d", i))
            await producer.send_and_wait(source, key=orjson.dumps({"id": i}), value=None)
        assert run_cli(settings, "erase", "--task-id", "review-9", "--pipeline", "reviews-cdc",
                       "--source-key", '{"id":9}').returncode == 0  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            scrape = await worker.scrape()
            if scrape.value("llm_streams_erasures_total") >= 5:
                break
            await asyncio.sleep(0.5)
        states = {i: run_cli(settings, "status", f"review-{i}") for i in (0, 5, 9)}
    finally:
        await producer.stop()
        worker.stop()

    erased = {0, 1, 2, 3, 9}
    assert scrape.value("llm_streams_erasures_total", pipeline="reviews-cdc", via="source") == 4
    assert scrape.value("llm_streams_erasures_total", pipeline="reviews-cdc", via="command") == 1
    in_sink = await _latest(settings, sink)
    live = {orjson.loads(k)["id"] for k, v in in_sink.items() if v is not None}
    assert live == set(range(10)) - erased  # the others stay
    assert {orjson.loads(k)["id"] for k, v in in_sink.items() if v is None} == erased
    results = await _latest(settings, settings.topics.results)
    answered = [orjson.loads(v)["task_id"] for v in results.values() if v is not None]
    assert sorted(answered) == sorted(f"review-{i}" for i in range(10) if i not in erased)
    assert sum(v is None for v in results.values()) == len(erased)  # tombstones, one each
    assert states[5].returncode == 0 and "succeeded" in states[5].stdout
    for i in (0, 9):  # nothing of them in the task store either
        assert states[i].returncode == 1 and "no state for task" in states[i].stderr


def _registry_get(url: str, path: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url + path, timeout=10) as reply:
        return orjson.loads(reply.read())


@pytest.mark.parametrize("fmt", ["json_schema", "avro"])
async def test_a_registry_sink_is_framed_under_its_registered_schema_and_a_breaking_change_stops_the_start(
    make_settings: Any, simulator: SimulatorServer, schema_registry: str, tmp_path: Path,
    fmt: str,
) -> None:  # fmt: skip
    """Its consumers read it as they read their other registry topics: the registry's wire
    format under the schema registered for `<topic>-value`, which its records meet (JSON
    Schema) or are read back with (Avro). A sink whose schema the subject's compatibility
    refuses does not start, said why."""
    import io

    import fastavro
    from jsonschema import Draft202012Validator

    pipelines = tmp_path / "pipelines"
    shutil.copytree(ROOT / "pipelines", pipelines)
    sink = f"comments.scored-{uuid.uuid4().hex[:8]}"
    path = pipelines / "comment-analysis.yaml"
    original = path.read_text()
    path.write_text(original + f"sink:\n  topic: {sink}\n  shape: output\n  format: {fmt}\n")
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1"}, pipelines_dir=pipelines,
                             schema_registry={"url": schema_registry})  # fmt: skip
    tasks = [{"task_id": f"j-{i}", "pipeline": "comment-analysis",
              "input": {"text": f"Comment {i}: the lid is loud."}} for i in range(20)]  # fmt: skip
    await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        records = await _wait_for(settings, sink, len(tasks), worker)
    finally:
        worker.stop()
    latest = _registry_get(schema_registry, f"/subjects/{sink}-value/versions/latest")
    schema = orjson.loads(latest["schema"])
    for record in records:
        assert record.value[0] == 0 and int.from_bytes(record.value[1:5], "big") == latest["id"]
        if fmt == "avro":
            back = fastavro.schemaless_reader(io.BytesIO(record.value[5:]),
                                              fastavro.parse_schema(schema))  # fmt: skip
            assert back["sentiment"] in ("positive", "negative", "neutral", "mixed")  # type: ignore[index,call-overload]
        else:
            Draft202012Validator(schema).validate(orjson.loads(record.value[5:]))
    names = [f["name"] for f in schema["fields"]] if fmt == "avro" else list(schema["properties"])
    assert "sentiment" in names  # the output's own schema

    # The same sink made to carry the envelope: new required fields, which BACKWARD refuses.
    path.write_text(original + f"sink:\n  topic: {sink}\n  shape: envelope\n  format: {fmt}\n")
    refused = run_cli(settings, "worker", timeout_s=90)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "compatibility" in refused.stderr and f"{sink}-value" in refused.stderr
