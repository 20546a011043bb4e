"""Exactly-once when a partition's producer is fenced while the worker still owns the
partition (its transaction timed out, or anything else bumped the epoch): the worker
starts the partition again from its committed offsets instead of dropping its results."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import WorkerProcess, collect, produce

pytestmark = pytest.mark.integration

TASKS = 1500


async def test_a_partition_fenced_without_a_takeover_recovers_and_loses_nothing(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 100, "fixed"
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        batch={"size": 50, "concurrency": 32},
        kafka={"session_timeout_s": 6, "commit_interval_s": 0.5},
        processing_guarantee="exactly_once",
    )  # fmt: skip
    tasks = [{"task_id": f"f-{i:05d}", "pipeline": "comment-analysis",
              "input": {"text": f"Comment {i}: fine kettle, loud lid."}} for i in range(TASKS)]  # fmt: skip
    offsets = await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert worker.alive(), worker.log_tail()
            try:
                done = (await worker.scrape()).value("llm_streams_tasks_completed_total")
            except OSError:
                done = 0
            if done >= 300:
                break
            await asyncio.sleep(0.2)
        # Another producer with partition 0's transactional id: the worker's producer of
        # partition 0 is fenced and its open transaction aborted, while the group still
        # gives partition 0 to this worker.
        zombie = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers,
                                  transactional_id=f"{settings.app_id}-eos-0")  # fmt: skip
        await zombie.start()
        await zombie.stop()
        got = await collect(settings, set(offsets), timeout_s=240, worker=worker,
                            read_committed=True, settle_s=3)  # fmt: skip
        metrics = await worker.scrape()
    finally:
        worker.stop()
    assert not got.dead_letters, got.dead_letters[:3]
    assert len(got.results) == TASKS, len(got.results) - TASKS  # none lost, none twice
    assert {r["task_id"] for r in got.results} == {t["task_id"] for t in tasks}
    assert metrics.value("llm_streams_partitions_restarted_total") >= 1, worker.log_tail()
