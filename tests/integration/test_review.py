"""Results a person should see also land in the review topic, with the reasons."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer

from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import WorkerProcess, collect, produce

pytestmark = pytest.mark.integration


async def test_contradicting_ratings_go_to_review(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"})
    angry_five_stars = [{"task_id": f"a-{i}", "pipeline": "comment-analysis",
                         "input": {"text": f"Terrible, broke on day {i}.", "rating": 5}}
                        for i in range(6)]  # fmt: skip
    happy_five_stars = [{"task_id": f"h-{i}", "pipeline": "comment-analysis",
                         "input": {"text": f"Great, I love it ({i}).", "rating": 5}}
                        for i in range(6)]  # fmt: skip
    tasks = angry_five_stars + happy_five_stars
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        offsets = await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
        got = await collect(settings, set(offsets), timeout_s=120, worker=worker)
        metrics = await worker.scrape()
    finally:
        worker.stop()
    assert len(got.results) == len(tasks)
    consumer = AIOKafkaConsumer(settings.topics.review, bootstrap_servers=settings.bootstrap_servers,
                                auto_offset_reset="earliest", group_id=f"r-{uuid.uuid4().hex[:6]}")  # fmt: skip
    await consumer.start()
    flagged: dict[str, Any] = {}
    try:
        while batch := await consumer.getmany(timeout_ms=3000):
            for records in batch.values():
                for r in records:
                    value = orjson.loads(r.value)
                    flagged[value["task_id"]] = value
                    assert r.key.decode() == value["result_key"]
    finally:
        await consumer.stop()
    contradicting = {
        t for t, v in flagged.items() if "rating_contradicts" in v["review"]["reasons"]
    }
    assert contradicting == {t["task_id"] for t in angry_five_stars}
    results = {r["task_id"]: r for r in got.results}
    for task_id in contradicting:  # the result itself, plus why
        assert flagged[task_id]["output"] == results[task_id]["output"]
    reviews = metrics.value("llm_streams_reviews_total", reason="rating_contradicts")
    assert reviews == len(angry_five_stars)
