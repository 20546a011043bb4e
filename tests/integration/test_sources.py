"""Existing topics as they are, on real Kafka: a Debezium-shaped CDC topic and a plain JSON
topic with no envelope are analysed end to end (task ids from the mapping, results keyed
as any task's); deletes and tombstones are skipped; what cannot be mapped ends as an
invalid_input dead letter."""

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
from tests.integration.helpers import WorkerProcess, collect

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
    rows = [{"id": i, "body": f"Review {i}: the strap broke after a week.",
             "product_name": "Bag", "stars": 1 + i % 5} for i in range(1, 9)]  # fmt: skip
    cdc: list[tuple[bytes | None, bytes | None]] = [
        (orjson.dumps({"id": r["id"]}), _change("cru"[i % 3], r)) for i, r in enumerate(rows)
    ]
    cdc += [
        (b'{"id": 99}', _change("d", None)),  # a delete: skipped
        (b'{"id": 99}', None),  # its tombstone: skipped
        (b'{"id": 100}', b"{not json"),  # dead letter: source_not_json
        (b'{"id": 101}', _change("c", {"id": 101, "stars": 2})),  # no body: source_pointer
    ]
    plain: list[tuple[bytes | None, bytes | None]] = [
        (f"c-{i}".encode(), orjson.dumps({"comment": {"text": f"Love it, number {i}!"}}))
        for i in range(5)
    ]
    plain.append((None, b'{"comment": {"text": "no key"}}'))  # dead letter: source_key
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await _publish(settings, cdc_topic, cdc)
        await _publish(settings, plain_topic, plain)
        wanted = {f"review-{r['id']}" for r in rows} | {f"c-{i}" for i in range(5)}
        got = await collect(settings, set(), timeout_s=120, worker=worker, settle_s=2.0,
                            until=lambda g: wanted <= {r["task_id"] for r in g.results}
                            and len(g.dead_letters) >= 3)  # fmt: skip
        scrape = await worker.scrape()
    finally:
        worker.stop()

    by_task = {r["task_id"]: r for r in got.results}
    assert set(by_task) == wanted
    assert by_task["review-3"]["pipeline"] == "reviews-cdc"
    assert by_task["c-2"]["pipeline"] == "plain-comments"
    assert all(r["output"]["sentiment"] for r in got.results)
    codes = sorted(d["error"]["code"] for d in got.dead_letters)
    assert codes == ["source_key", "source_not_json", "source_pointer"], codes
    assert all(d["error"]["category"] == "invalid_input" for d in got.dead_letters)
    assert {d["source"]["topic"] for d in got.dead_letters} == {cdc_topic, plain_topic}
    count = scrape.value
    assert count("llm_streams_source_records_total", pipeline="reviews-cdc",
                 outcome="forwarded") == 8  # fmt: skip
    assert count("llm_streams_source_records_total", pipeline="reviews-cdc",
                 outcome="skipped") == 2  # fmt: skip
    assert count("llm_streams_source_records_total", pipeline="reviews-cdc",
                 outcome="dead_letter") == 2  # fmt: skip
    assert count("llm_streams_source_records_total", pipeline="plain-comments",
                 outcome="forwarded") == 5  # fmt: skip
