"""Ten SIGKILLs at random moments while 5,000 tasks run; restart each time.

No task is lost; a task is answered again only when its record was taken but
not committed at a kill (then under the same result key, with the same output);
the state tables come back from their changelogs, so finished records are not
sent to the LLM again. With exactly-once (Kafka transactions), a read_committed
reader of the results sees each record's result exactly once: writes in flight
at a kill are aborted, and a record whose result committed before its offset
finds in the store that it wrote it and writes nothing — also when another
record of the same task (500 tasks are sent twice) wrote after it.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer

from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import (
    WorkerProcess,
    assert_each_task_answered_once,
    collect,
    committed,
    produce,
)

pytestmark = pytest.mark.integration

TASKS = 5000
KILLS = 10
DUPLICATES = 500  # tasks sent twice: two records of one task, each to be answered once


async def _latest(settings: Any, topic: str) -> dict[bytes, bytes]:
    """The latest value per key of a topic (a table's changelog)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=settings.bootstrap_servers,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                group_id=f"read-{uuid.uuid4().hex[:6]}")  # fmt: skip
    await consumer.start()
    latest: dict[bytes, bytes] = {}
    try:
        while batch := await consumer.getmany(timeout_ms=2000):
            for records in batch.values():
                for r in records:
                    latest[r.key] = r.value
        return latest
    finally:
        await consumer.stop()


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
async def test_ten_sigkills_lose_nothing_and_repeat_only_uncommitted_work(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path, guarantee: str
) -> None:
    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 50, "fixed"
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        batch={"size": 50, "concurrency": 32},
        kafka={"session_timeout_s": 6, "commit_interval_s": 0.2},
        store="rocksdb://",  # the disk-backed maps, killed and reopened ten times
        processing_guarantee=guarantee,
    )
    tasks = [{"task_id": f"c-{i:05d}", "pipeline": "comment-analysis",
              "input": {"text": f"Comment {i}: the zip broke on day {i % 30}."}}
             for i in range(TASKS)]  # fmt: skip
    records = [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks]
    records += [records[i * (TASKS // DUPLICATES)] for i in range(DUPLICATES)]
    offsets = await produce(settings, records)
    rng = random.Random(7)
    uncommitted_at_kills = 0
    for k in range(KILLS):
        start_committed = await committed(settings)
        worker = WorkerProcess(settings, tmp_path / f"worker-{k}.log").start()
        try:
            # Let it get going, then kill it at a random moment of its work.
            target = rng.randint(100, 400)
            deadline = time.monotonic() + 120
            taken = 0.0
            while time.monotonic() < deadline:
                assert worker.alive(), worker.log_tail()
                try:
                    metrics = await worker.scrape()
                except OSError:
                    await asyncio.sleep(0.2)
                    continue
                taken = metrics.value("llm_streams_tasks_received_total")
                if metrics.value("llm_streams_tasks_completed_total") >= target:
                    break
                await asyncio.sleep(rng.uniform(0.05, 0.3))
            else:
                raise AssertionError(f"run {k} made no progress:\n{worker.log_tail()}")
            worker.kill()
        finally:
            worker.stop()
        # Records this run took that its group had not committed: the only ones that
        # may reach the LLM again. (+ one micro-batch taken between scrape and kill.)
        uncommitted_at_kills += max(0, start_committed + int(taken) - await committed(settings))
        uncommitted_at_kills += settings.batch.size

    final = WorkerProcess(settings, tmp_path / "worker-final.log").start()
    try:
        # Exactly-once: what a read_committed reader sees (aborted writes never show).
        got = await collect(settings, set(offsets), timeout_s=300, worker=final,
                            read_committed=guarantee == "exactly_once")  # fmt: skip
        metrics = await final.scrape()
    finally:
        final.stop()

    assert not got.dead_letters, got.dead_letters[:3]
    keys = assert_each_task_answered_once(got, {t["task_id"] for t in tasks})
    if guarantee == "exactly_once":  # each record's result exactly once, no repeat at all
        assert len(got.results) == len(records), len(got.results) - len(records)
        assert {(r["source"]["partition"], r["source"]["offset"]) for r in got.results} == set(
            offsets
        )
    calls = simulator.sim.snapshot()["requests"]
    assert calls <= TASKS + uncommitted_at_kills, (calls, uncommitted_at_kills)
    # The last worker recovered the tables: records finished before were not re-sent.
    assert metrics.value("llm_streams_tasks_completed_total", outcome="already_done") > 0

    # The task-state table (its changelog) says every task succeeded, under its key.
    states = await _latest(settings, f"{settings.app_id}-task-state-changelog")
    by_task = {k.decode(): orjson.loads(v) for k, v in states.items()}
    assert set(by_task) == {t["task_id"] for t in tasks}
    for task_id, state in by_task.items():
        assert state["status"] == "succeeded", state
        assert state["result_key"] == keys[task_id]
        assert state["history"] and state["history"][-1]["status"] == "succeeded"
