"""A bounded stop: SIGTERM with tasks in flight, and the broker and the LLM endpoint gone
right after. The worker exits within its shutdown grace saying what it left behind, and
the next worker answers every task that was left, once."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.dev.brokers.apache import ApacheKafka
from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import (
    WorkerProcess,
    assert_each_task_answered_once,
    collect,
    produce,
)

pytestmark = pytest.mark.integration

GRACE_S = 8.0


async def test_sigterm_with_broker_and_endpoint_gone_exits_within_the_grace(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 2000, "fixed"
    tasks = [{"task_id": f"s-{i:04d}", "pipeline": "comment-analysis",
              "input": {"text": f"Comment {i}: the strap broke, the rest is fine."}}
             for i in range(300)]  # fmt: skip
    with ApacheKafka(heap_mb=512) as kafka:
        settings = make_settings(
            kafka={"broker_url": kafka.url},
            llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
            batch={"concurrency": 64},
            shutdown_grace_s=GRACE_S,
        )  # fmt: skip
        await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
        first = WorkerProcess(settings, tmp_path / "worker-1.log").start()
        try:
            deadline = time.monotonic() + 120
            while simulator.sim.in_flight < 32 and time.monotonic() < deadline:
                assert first.alive(), first.log_tail()
                await asyncio.sleep(0.2)
            assert simulator.sim.in_flight >= 32, "no tasks in flight to leave behind"
            assert first.proc is not None
            first.proc.send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()
            # The whole platform goes away while the worker stops.
            await asyncio.to_thread(kafka.stop_node, 0, kill=True)
            await simulator.stop()
            exit_code = await asyncio.to_thread(first.proc.wait, 120)
            took = time.monotonic() - stopped_at
        finally:
            first.kill()
        log = (tmp_path / "worker-1.log").read_text(errors="replace")
        assert took <= GRACE_S + 10, f"exited {took:.0f}s after SIGTERM:\n{first.log_tail()}"
        assert "left unacknowledged" in log, first.log_tail()
        assert exit_code == 0, first.log_tail()

        # Back up: the next worker answers everything that was left, once.
        await asyncio.to_thread(kafka.start_node, 0)
        await simulator.start()
        simulator.sim.config.latency_ms = 0
        await _the_next_worker_answers_each_once(settings, tasks, tmp_path)


async def test_sigterm_finishes_the_started_tasks_and_leaves_the_rest_at_once(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    """A worker held by a rate limit has taken far more records than it has started.
    Told to stop, it starts none of them: it finishes the tasks it started (at most its
    concurrency of calls after the signal, where it used to work through everything it
    had taken at the limit's pace before leaving the group), leaves the others
    unacknowledged, and the next worker answers them: each task once, no prompt paid
    for twice."""
    simulator.sim.config.latency_ms, simulator.sim.config.latency_dist = 300, "fixed"
    simulator.sim.config.rpm = 600  # 10 calls a second
    concurrency = 8
    tasks = [{"task_id": f"q-{i:04d}", "pipeline": "comment-analysis",
              "input": {"text": f"Comment {i}: the zip jammed on day {i}."}}
             for i in range(300)]  # fmt: skip
    with ApacheKafka(heap_mb=512) as kafka:
        settings = make_settings(
            kafka={"broker_url": kafka.url},
            llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
            batch={"concurrency": concurrency},
        )  # fmt: skip
        await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
        first = WorkerProcess(settings, tmp_path / "worker-1.log").start()
        try:
            # The signal once the worker holds many records taken and not started (the
            # records its micro-batches gave out, less those its loop reached): how many
            # that is at a given moment depends on how the batches fell (the first one is
            # what came with the first record, the next fill while slots are busy).
            deadline = time.monotonic() + 120
            while True:
                assert first.alive(), first.log_tail()
                assert time.monotonic() < deadline, "the worker never held records back"
                if simulator.sim.by_status[200] >= 30:
                    scrape = await first.scrape()
                    held = scrape.value("llm_streams_batch_size_sum") - scrape.value(
                        "llm_streams_tasks_received_total"
                    )
                    if held >= 4 * concurrency:
                        break
                await asyncio.sleep(0.2)
            assert first.proc is not None
            first.proc.send_signal(signal.SIGTERM)
            answered_at_signal = simulator.sim.by_status[200]
            exit_code = await asyncio.to_thread(first.proc.wait, 120)
            answered_after = simulator.sim.by_status[200] - answered_at_signal
        finally:
            first.kill()
        log = (tmp_path / "worker-1.log").read_text(errors="replace")
        assert exit_code == 0, first.log_tail()
        assert "left unacknowledged for the partitions' next owner" in log, first.log_tail()
        # The calls in flight, and the few started before the signal reached the worker;
        # not the records it had taken (it used to answer them all before leaving).
        left = int(re.search(r"(\d+) taken and not started are left", log).group(1))  # type: ignore[union-attr]
        assert left > 2 * concurrency, first.log_tail()
        assert answered_after <= 2 * concurrency, (answered_after, first.log_tail())
        assert "stopped after the" not in log  # not by the watchdog: the stop ended itself

        await _the_next_worker_answers_each_once(settings, tasks, tmp_path)
    assert simulator.sim.snapshot()["duplicate_successes"] == 0


async def _the_next_worker_answers_each_once(
    settings: Any, tasks: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A second worker answers every task the first left: none dead-lettered, each once."""
    second = WorkerProcess(settings, tmp_path / "worker-2.log").start()
    try:
        got = await collect(settings, set(), timeout_s=240, worker=second,
                            until=lambda g: {r["task_id"] for r in g.results}
                            >= {t["task_id"] for t in tasks})  # fmt: skip
    finally:
        second.stop()
    assert not got.dead_letters, [d["error"] for d in got.dead_letters[:3]]
    assert_each_task_answered_once(got, {t["task_id"] for t in tasks})
