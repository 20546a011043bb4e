"""The task store on disk, on a real broker: a worker that comes back reads only what its
topics gained while it was away, and still answers from everything it held before."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import TopicPartition

from streams.dev.simulator import SimulatorServer
from streams.kafka import clients
from streams.kafka.topics import ledger_topic, state_topic
from streams.settings import Settings
from tests.integration.helpers import WorkerProcess, collect, produce

pytestmark = pytest.mark.integration

LOADED = "llm_streams_state_loaded_records_total"


async def _store_records(settings: Settings) -> int:
    """Records in the store's four topics (their end offsets, summed)."""
    topics = [settings.topics.results, settings.topics.dead_letters, state_topic(settings),
              ledger_topic(settings)]  # fmt: skip
    consumer = clients.consumer(settings, purpose="ends", group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(t, p) for t in topics for p in range(settings.kafka.partitions)]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


def _records(first: int, last: int) -> list[tuple[bytes | None, bytes | None]]:
    return [(f"s-{i:04d}".encode(), orjson.dumps({
        "task_id": f"s-{i:04d}", "pipeline": "comment-analysis",
        "input": {"text": f"Comment {i}: arrived on day {i % 9}."}}))
        for i in range(first, last)]  # fmt: skip


async def _answer(settings: Settings, records: Any, log: Path) -> float:
    """Run a worker until `records` are answered; records it read into its store."""
    offsets = await produce(settings, records)
    worker = WorkerProcess(settings, log).start()
    try:
        got = await collect(settings, set(offsets), timeout_s=120, worker=worker)
        assert set(offsets) <= got.sources(), worker.log_tail()
        loaded = (await worker.scrape()).value(LOADED)
    finally:
        worker.stop()
    assert worker.proc is not None and worker.proc.returncode == 0, worker.log_tail()
    return loaded


async def test_a_worker_back_on_its_disk_reads_only_what_its_topics_gained(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        kafka={"partitions": 2},
    )
    assert settings.store == "rocksdb://"  # the default
    other = settings.model_copy(update={"data_dir": tmp_path / "other-worker"})

    assert await _answer(settings, _records(0, 150), tmp_path / "first.log") == 0
    held = await _store_records(settings)
    # Meanwhile another worker, with a disk of its own, owns the partitions and answers more:
    # it reads everything the first one wrote.
    assert await _answer(other, _records(150, 200), tmp_path / "other.log") == held
    gained = await _store_records(settings) - held
    assert gained > 0

    calls = simulator.sim.snapshot()["requests"]
    # The first worker again: it reads what it missed, not the 150 tasks it held...
    loaded = await _answer(settings, _records(0, 200), tmp_path / "again.log")
    assert loaded == gained
    # ... and answers all 200 tasks again from its store: not one LLM call.
    assert simulator.sim.snapshot()["requests"] == calls


async def _latest(settings: Settings, topic: str) -> dict[bytes, bytes | None]:
    """The latest value of each key of `topic` (None: a tombstone)."""
    consumer = clients.consumer(settings, topic, purpose="latest", group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)  # fmt: skip
    await consumer.start()
    latest: dict[bytes, bytes | None] = {}
    try:
        while batch := await consumer.getmany(timeout_ms=2000):
            for records in batch.values():
                latest.update((r.key, r.value) for r in records)
        return latest
    finally:
        await consumer.stop()


async def test_entries_past_their_retention_are_tombstoned_and_answered_again_when_asked(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    three_s = 3 / 86_400
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        kafka={"partitions": 2},
        retention={"results_days": three_s, "tasks_days": three_s, "check_s": 1},
    )
    records = _records(0, 20)
    offsets = await produce(settings, records)
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        got = await collect(settings, set(offsets), timeout_s=120, worker=worker)
        keys = {key.encode() for key in got.result_keys}
        assert len(keys) == 20
        expired = {"results": 0.0, "tasks": 0.0}
        for _ in range(60):
            metrics = await worker.scrape()
            expired = {m: metrics.value("llm_streams_store_expired_total", map=m) for m in expired}
            if min(expired.values()) >= 20:
                break
            await asyncio.sleep(0.5)
        assert expired == {"results": 20, "tasks": 20}, worker.log_tail()
    finally:
        worker.stop()

    results = await _latest(settings, settings.topics.results)
    states = await _latest(settings, state_topic(settings))
    assert all(results[key] is None for key in keys)  # tombstoned on the compacted topics
    assert all(states[key] is None for key, _ in records)

    # A task past its retention, asked again (by a worker back on its disk): answered again,
    # with an LLM call, under the same result key.
    calls = simulator.sim.snapshot()["requests"]
    again = await produce(settings, records[:1])
    worker = WorkerProcess(settings, tmp_path / "again.log").start()
    try:
        got = await collect(settings, set(again), timeout_s=120, worker=worker)
    finally:
        worker.stop()
    answer = [(r, k) for r, k in zip(got.results, got.result_keys, strict=True)
              if (r["source"]["partition"], r["source"]["offset"]) == again[0]]  # fmt: skip
    assert len(answer) == 1 and answer[0][1].encode() in keys
    assert simulator.sim.snapshot()["requests"] == calls + 1
