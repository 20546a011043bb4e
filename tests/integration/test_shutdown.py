"""A bounded stop: SIGTERM with tasks in flight, and the broker and the LLM endpoint gone
right after. The worker exits within its shutdown grace saying what it left behind, and
the next worker answers every task that was left, once."""

from __future__ import annotations

import asyncio
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
        second = WorkerProcess(settings, tmp_path / "worker-2.log").start()
        try:
            got = await collect(settings, set(), timeout_s=180, worker=second,
                                until=lambda g: {r["task_id"] for r in g.results}
                                >= {t["task_id"] for t in tasks})  # fmt: skip
        finally:
            second.stop()
    assert not got.dead_letters, [d["error"] for d in got.dead_letters[:3]]
    assert_each_task_answered_once(got, {t["task_id"] for t in tasks})
