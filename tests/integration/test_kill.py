"""SIGKILL a worker with LLM calls in flight, restart it: no task is lost (at-least-once)."""

from __future__ import annotations

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


async def _wait_for_results(
    settings: Any, worker: WorkerProcess, sim: SimulatorServer, n: int
) -> int:
    """Block until n results exist and LLM calls are in flight; return results seen."""
    consumer = AIOKafkaConsumer(
        settings.topics.results,
        bootstrap_servers=settings.bootstrap_servers,
        group_id=f"watch-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    seen = 0
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            assert worker.alive(), worker.log_tail()
            batch = await consumer.getmany(timeout_ms=100)
            seen += sum(len(v) for v in batch.values())
            if seen >= n and sim.sim.in_flight > 0:
                return seen
        raise AssertionError(f"only {seen} results in time:\n{worker.log_tail()}")
    finally:
        await consumer.stop()


# Also with the consumer on Faust's thread (`kafka.consumer_thread`): its drain is the
# worker's too (streams.worker.faust_private.Consumer).
@pytest.mark.parametrize("consumer_thread", [False, True], ids=["in-loop", "threaded"])
async def test_sigkill_mid_batch_loses_nothing(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path, consumer_thread: bool
) -> None:
    simulator.sim.config.latency_ms = 300
    simulator.sim.config.latency_jitter_ms = 100
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        batch={"size": 50, "window_s": 0.05, "concurrency": 32},
        kafka={"commit_interval_s": 1.0, "consumer_thread": consumer_thread},
    )
    tasks = [
        {"task_id": f"k-{i:04d}", "pipeline": "comment-analysis",
         "input": {"text": f"Comment {i}: arrived late but works great."}}
        for i in range(800)
    ]  # fmt: skip
    offsets = await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])

    first = WorkerProcess(settings, tmp_path / "worker-1.log").start()
    try:
        await _wait_for_results(settings, first, simulator, 150)
        in_flight_at_kill = simulator.sim.in_flight
        first.kill()
    finally:
        first.stop()
    assert in_flight_at_kill > 0  # the kill really hit calls in flight
    called_before = simulator.sim.snapshot()["requests"]
    assert called_before < len(tasks)  # and it happened mid-run
    # Records before the committed offsets are finished for good; only calls made for
    # records after them (answered, or cut by the kill) may be made again.
    done_for_good = await committed(settings)

    second = WorkerProcess(settings, tmp_path / "worker-2.log").start()
    try:
        got = await collect(settings, set(offsets), timeout_s=180, worker=second)
    finally:
        second.stop()

    assert not got.dead_letters
    # Repeats are allowed (at-least-once) but only under the same key with the same output.
    assert_each_task_answered_once(got, {t["task_id"] for t in tasks})
    may_repeat = called_before - done_for_good
    calls = simulator.sim.snapshot()["requests"]
    assert calls <= len(tasks) + may_repeat, (calls, may_repeat)
    assert len(got.results) - len(tasks) <= may_repeat
