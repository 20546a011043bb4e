"""Existing topics as they are, on real Kafka: a Debezium-shaped CDC topic and a plain JSON
topic with no envelope are analysed end to end (task ids from the mapping, results keyed
as any task's); a delete erases its task, a tombstone is skipped; what cannot be mapped ends as an
invalid_input dead letter, and so does one whose task is larger than `llm-tasks` takes."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka.admin import NewTopic

from streams.dev.simulator import SimulatorServer
from streams.kafka import clients
from streams.kafka.topics import ensure_topics
from tests.integration.helpers import (
    WorkerProcess,
    collect,
    register_schema,
    registry_framed,
    topic_takes,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _change(op: str, row: dict[str, Any] | None) -> bytes:
    return orjson.dumps({"schema": {}, "payload": {"op": op, "before": None, "after": row}})


async def _publish(settings: Any, topic: str, records: list[tuple[bytes | None, bytes | None]]
                   ) -> None:  # fmt: skip
    admin = clients.admin(settings)
    await admin.start()
    try:  # the user's topic, with its own partition count
        await admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    finally:
        await admin.close()
    producer = clients.producer(settings, acks="all")
    await producer.start()
    try:
        for key, value in records:
            await producer.send_and_wait(topic, key=key, value=value)
    finally:
        await producer.stop()


async def test_a_cdc_topic_and_a_plain_topic_are_analysed_as_they_are(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    pipelines = tmp_path / "pipelines"
    shutil.copytree(ROOT / "pipelines", pipelines)
    suffix = uuid.uuid4().hex[:8]  # the user's topics, new for this run
    cdc_topic, plain_topic = f"shop.reviews-{suffix}", f"app.comments-{suffix}"
    for example, topic in (("reviews-cdc", cdc_topic), ("plain-comments", plain_topic)):
        text = (ROOT / "examples" / "sources" / f"{example}.yaml").read_text()
        old = "shop.public.reviews" if example == "reviews-cdc" else "app.comments"
        (pipelines / f"{example}.yaml").write_text(text.replace(f"[{old}]", f"[{topic}]"))
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1"}, pipelines_dir=pipelines)  # fmt: skip
    await ensure_topics(settings)
    # llm-tasks takes 16 KiB records (read by the worker at start): 20 KB will not fit
    await topic_takes(settings, settings.topics.tasks, 16384)
    rows = [{"id": i, "body": f"Review {i}: the strap broke after a week.",
             "product_name": "Bag", "stars": 1 + i % 5} for i in range(1, 9)]  # fmt: skip
    cdc: list[tuple[bytes | None, bytes | None]] = [
        (orjson.dumps({"id": r["id"]}), _change("cru"[i % 3], r)) for i, r in enumerate(rows)
    ]
    cdc += [
        (
            b'{"id": 99}',
            orjson.dumps(
                {
                    "schema": {},
                    "payload": {  # a delete: erased
                        "op": "d",
                        "before": {"id": 99},
                        "after": None,
                    },
                }
            ),
        ),
        (b'{"id": 99}', None),  # its tombstone: skipped
        (b'{"id": 100}', b"{not json"),  # dead letter: source_not_json
        (b'{"id": 101}', _change("c", {"id": 101, "stars": 2})),  # no body: source_pointer
    ]
    plain: list[tuple[bytes | None, bytes | None]] = [
        (f"c-{i}".encode(), orjson.dumps({"comment": {"text": f"Love it, number {i}!"}}))
        for i in range(5)
    ]
    plain.append((None, b'{"comment": {"text": "no key"}}'))  # dead letter: source_key
    big = orjson.dumps({"comment": {"text": "Too long. " * 2000}})  # 20 KB: source_too_large
    plain.append((b"c-big", big))
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await _publish(settings, cdc_topic, cdc)
        await _publish(settings, plain_topic, plain)
        wanted = {f"review-{r['id']}" for r in rows} | {f"c-{i}" for i in range(5)}
        got = await collect(settings, set(), timeout_s=120, worker=worker, settle_s=2.0,
                            until=lambda g: wanted <= {r["task_id"] for r in g.results}
                            and len(g.dead_letters) >= 4)  # fmt: skip
        scrape = await worker.scrape()
    finally:
        worker.stop()

    by_task = {r["task_id"]: r for r in got.results}
    assert set(by_task) == wanted
    assert by_task["review-3"]["pipeline"] == "reviews-cdc"
    assert by_task["c-2"]["pipeline"] == "plain-comments"
    assert all(r["output"]["sentiment"] for r in got.results)
    codes = sorted(d["error"]["code"] for d in got.dead_letters)
    assert codes == ["source_key", "source_not_json", "source_pointer", "source_too_large"], codes
    (too_large,) = [d for d in got.dead_letters if d["error"]["code"] == "source_too_large"]
    assert too_large["source"]["topic"] == plain_topic
    assert "bytes, over the" in too_large["error"]["message"]
    assert all(d["error"]["category"] == "invalid_input" for d in got.dead_letters)
    assert {d["source"]["topic"] for d in got.dead_letters} == {cdc_topic, plain_topic}
    count = scrape.value
    assert count("llm_streams_source_records_total", pipeline="reviews-cdc",
                 outcome="forwarded") == 8  # fmt: skip
    assert count("llm_streams_source_records_total", pipeline="reviews-cdc",
                 outcome="skipped") == 1  # fmt: skip
    assert count("llm_streams_source_records_total", pipeline="reviews-cdc",
                 outcome="erased") == 1  # fmt: skip
    assert count("llm_streams_erasures_total", pipeline="reviews-cdc", via="source") == 1
    assert count("llm_streams_source_records_total", pipeline="reviews-cdc",
                 outcome="dead_letter") == 2  # fmt: skip
    assert count("llm_streams_source_records_total", pipeline="plain-comments",
                 outcome="forwarded") == 5  # fmt: skip
    assert count("llm_streams_source_records_total", pipeline="plain-comments",
                 outcome="dead_letter") == 2  # fmt: skip


KEY = {"type": "record", "name": "Key", "namespace": "shop.public.reviews",
       "fields": [{"name": "id", "type": "int"}]}  # fmt: skip
ROW = {"type": "record", "name": "Value", "namespace": "shop.public.reviews",
       "fields": [{"name": "id", "type": "int"},
                  {"name": "body", "type": ["null", "string"], "default": None},
                  {"name": "product_name", "type": "string"},
                  {"name": "stars", "type": "int"}]}  # fmt: skip
ENVELOPE = {"type": "record", "name": "Envelope", "namespace": "shop.public.reviews",
            "fields": [{"name": "before", "type": ["null", ROW], "default": None},
                       {"name": "after", "type": ["null", "shop.public.reviews.Value"],
                        "default": None},
                       {"name": "op", "type": "string"},
                       {"name": "ts_ms", "type": "long"}]}  # fmt: skip
COMMENT = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
           "required": ["text"], "properties": {"text": {"type": "string"}}}  # fmt: skip

JSON_COMMENTS = """
name: json-comments
default_version: v1
output_schema: comment-analysis.output.schema.json
source:
  topics: [{topic}]
  format: registry
  task_id: key
  slots:
    text: /text
versions:
  v1:
    params: {{temperature: 0, max_tokens: 400}}
    response_format: json_schema
    slots:
      text: {{type: string, required: true, max_length: 8000}}
    system: Return the analysis of the comment as JSON.
    template: "Comment: <comment>{{{{ text }}}}</comment>"
"""


async def test_avro_and_json_schema_topics_are_read_through_a_real_schema_registry(
    make_settings: Any, simulator: SimulatorServer, schema_registry: str, tmp_path: Path
) -> None:
    pipelines = tmp_path / "pipelines"
    shutil.copytree(ROOT / "pipelines", pipelines)
    suffix = uuid.uuid4().hex[:8]
    avro_topic, json_topic = f"shop.reviews.avro-{suffix}", f"app.comments.json-{suffix}"
    text = (ROOT / "examples" / "sources" / "reviews-avro.yaml").read_text()
    (pipelines / "reviews-avro.yaml").write_text(
        text.replace("[shop.public.reviews.avro]", f"[{avro_topic}]"))  # fmt: skip
    (pipelines / "json-comments.yaml").write_text(JSON_COMMENTS.format(topic=json_topic))
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1"}, pipelines_dir=pipelines,
                             schema_registry={"url": schema_registry})  # fmt: skip
    await ensure_topics(settings)
    key_id = await register_schema(schema_registry, f"{avro_topic}-key", KEY)
    value_id = await register_schema(schema_registry, f"{avro_topic}-value", ENVELOPE)
    comment_id = await register_schema(schema_registry, f"{json_topic}-value", COMMENT, "JSON")

    def change(op: str, i: int, body: str | None = "The strap broke after a week.") -> bytes:
        row = {"id": i, "body": body, "product_name": "Bag", "stars": 1 + i % 5}
        return registry_framed(value_id, ENVELOPE, {"before": None, "after": None if op == "d" else row,
                                            "op": op, "ts_ms": 1_764_500_000_000})  # fmt: skip

    def key(i: int) -> bytes:
        return registry_framed(key_id, KEY, {"id": i})

    avro: list[tuple[bytes | None, bytes | None]] = [
        (key(i), change("cru"[i % 3], i)) for i in range(1, 7)
    ]
    avro += [
        (key(50), change("d", 50)),  # a delete: skipped
        (key(50), None),  # its tombstone: skipped
        (key(60), change("c", 60)[:-6]),  # truncated body: source_undecodable
        (key(61), b"\x00\x00\x01\x86\xa0" + change("c", 61)[5:]),  # id 100000: unknown
        (key(62), orjson.dumps({"op": "c"})),  # plain JSON: source_not_framed
        (key(63), change("c", 63, body=None)),  # no text (wrong type for the slot)
    ]
    plain: list[tuple[bytes | None, bytes | None]] = [
        (f"j-{i}".encode(), registry_framed(comment_id, None, {"text": f"Great blender {i}!"}))
        for i in range(3)
    ]
    plain.append(
        (b"j-bad", registry_framed(comment_id, None, {"text": 42}))
    )  # source_schema_mismatch
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await _publish(settings, avro_topic, avro)
        await _publish(settings, json_topic, plain)
        wanted = {f"review-{i}" for i in range(1, 7)} | {f"j-{i}" for i in range(3)}
        got = await collect(settings, set(), timeout_s=120, worker=worker, settle_s=2.0,
                            until=lambda g: wanted <= {r["task_id"] for r in g.results}
                            and len(g.dead_letters) >= 5)  # fmt: skip
        scrape = await worker.scrape()
    finally:
        worker.stop()

    by_task = {r["task_id"]: r for r in got.results}
    assert set(by_task) == wanted
    assert by_task["review-4"]["pipeline"] == "reviews-avro"
    assert by_task["j-1"]["pipeline"] == "json-comments"
    assert all(r["output"]["sentiment"] for r in got.results)
    codes = sorted(d["error"]["code"] for d in got.dead_letters)
    assert codes == ["missing_slot", "source_not_framed", "source_schema_mismatch",
                     "source_schema_unknown", "source_undecodable"], codes  # fmt: skip
    assert all(d["error"]["category"] == "invalid_input" for d in got.dead_letters)
    reasons = {d["error"]["code"]: d["error"]["message"] for d in got.dead_letters}
    assert "100000" in reasons["source_schema_unknown"]
    assert "/text" in reasons["source_schema_mismatch"]
    count = scrape.value
    assert count("llm_streams_source_records_total", pipeline="reviews-avro",
                 outcome="forwarded") == 7  # fmt: skip
    assert count("llm_streams_source_records_total", pipeline="reviews-avro",
                 outcome="skipped") == 2  # fmt: skip
    assert count("llm_streams_source_records_total", pipeline="reviews-avro",
                 outcome="dead_letter") == 3  # fmt: skip
    assert count("llm_streams_schema_lookups_total", outcome="fetched") == 3
    assert count("llm_streams_schema_lookups_total", outcome="unknown") == 1


async def test_records_whose_data_the_mapping_refuses_end_as_dead_letters_and_the_agent_goes_on(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    """A loosely typed upstream table: text where the filter compares a number, a zero
    the rating template divides by, headers without a value, 5% poison. Before, the
    first such record crashed the sources agent, which Faust restarted on the same record
    every few seconds: everything behind it on its partition waited. Every record ends
    as one result or one dead letter, and the agent never crashes."""
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    shutil.copy(ROOT / "pipelines" / "comment-analysis.yaml", pipelines)
    topic = f"shop.reviews-{uuid.uuid4().hex[:8]}"
    text = (ROOT / "examples" / "sources" / "reviews-cdc.yaml").read_text()
    text = text.replace("[shop.public.reviews]", f"[{topic}]").replace(
        '''filter: "value.payload is not none and value.payload.op in ['c', 'u', 'r']"''',
        '''filter: "value.payload.op != 'd' and value.payload.after.stars >= 1"''',
    ).replace('rating: "{{ value.payload.after.stars }}"',
              'rating: "{{ 10 // (value.payload.after.stars - 3) }} {{ headers.origin }}"')  # fmt: skip
    assert "stars >= 1" in text and "// (value" in text
    (pipelines / "reviews-cdc.yaml").write_text(text)
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1"}, pipelines_dir=pipelines)  # fmt: skip
    await ensure_topics(settings)
    rows: list[tuple[int, object]] = [(i, 1 + i % 5) for i in range(1, 41)]
    rows += [(100 + i, "4 stars") for i in range(2)]  # text where a number is expected
    admin = clients.admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    finally:
        await admin.close()
    producer = clients.producer(settings, acks="all")
    await producer.start()
    try:
        for i, stars in rows:
            row = {"id": i, "body": f"Review {i}: the strap broke.", "product_name": "Bag",
                   "stars": stars}  # fmt: skip
            headers = [("origin", None if i % 7 == 0 else b"eu")]  # some without a value
            await producer.send_and_wait(topic, key=orjson.dumps({"id": i}),
                                         value=_change("c", row), headers=headers)  # fmt: skip
        # A body nested 300 deep, and a delete naming a row id no task id may be: each
        # crashed the agent, the same record again after every restart.
        deep = {"id": 200, "body": [[[]]], "product_name": "Bag", "stars": 5}
        await producer.send_and_wait(topic, key=b'{"id": 200}', value=_change("c", deep).replace(
            b"[[[]]]", b"[" * 300 + b"]" * 300))  # fmt: skip
        delete = {"schema": {}, "payload": {"op": "d", "before": {"id": "9" * 600}, "after": None}}
        await producer.send_and_wait(topic, key=b'{"id": 201}', value=orjson.dumps(delete))
    finally:
        await producer.stop()
    # stars 3: 10 // 0 in the template; "4 stars" >= 1 in the filter.
    divides_by_zero = {f"review-{i}" for i, stars in rows if stars == 3}
    answered = {f"review-{i}" for i, stars in rows if isinstance(stars, int) and stars != 3}
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        got = await collect(settings, set(), timeout_s=120, worker=worker, settle_s=2.0,
                            until=lambda g: answered <= {r["task_id"] for r in g.results}
                            and len(g.dead_letters) >= len(divides_by_zero) + 4)  # fmt: skip
        log = worker.log_tail(2000)
    finally:
        worker.stop()
    assert {r["task_id"] for r in got.results} == answered
    assert len(got.results) == len(answered)  # once each
    codes = sorted(d["error"]["code"] for d in got.dead_letters)
    assert codes == sorted(["source_filter"] * 2 + ["source_slot"] * len(divides_by_zero)
                           + ["source_too_deep", "source_erase"]), codes  # fmt: skip
    reasons = " ".join(d["error"]["message"] for d in got.dead_letters)
    assert "TypeError" in reasons and "ZeroDivisionError" in reasons
    assert "Crashed" not in log, log[-3000:]
