"""Dead letters of an outage, re-queued once it is over; `status` shows the history."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import WorkerProcess, collect, produce, run_cli

pytestmark = pytest.mark.integration


async def test_redrive_requeues_retryable_dead_letters_and_status_shows_history(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    simulator.sim.config.error_500_rate = 1.0  # the provider is failing
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1",
             "max_attempts": 2, "backoff_base_s": 0.01, "backoff_max_s": 0.05},
        resilience={"breaker_min_calls": 10_000},
    )  # fmt: skip
    tasks = [{"task_id": f"r-{i:03d}", "pipeline": "comment-analysis",
              "input": {"text": f"Redrive me {i}, the strap snapped."}} for i in range(20)]  # fmt: skip
    records: list[tuple[bytes | None, bytes | None]] = [
        (t["task_id"].encode(), orjson.dumps(t)) for t in tasks
    ]
    records.append((b"bad", b"{not json"))  # bad input is never redriven
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        first = await produce(settings, records)
        got = await collect(settings, set(first), timeout_s=120, worker=worker)
        assert len(got.dead_letters) == 21 and not got.results
        assert {d["error"]["category"] for d in got.dead_letters} == {"upstream_error",
                                                                       "invalid_input"}  # fmt: skip

        shown = run_cli(settings, "status", "r-007")
        assert shown.returncode == 0, shown.stderr
        assert "dead_lettered" in shown.stdout and "upstream_error" in shown.stdout

        dry = run_cli(settings, "redrive", "--category", "upstream_error", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "would re-queue 20 task(s)" in dry.stdout
        simulator.sim.config.error_500_rate = 0.0  # the cause is gone
        done = run_cli(settings, "redrive", "--category", "upstream_error")
        assert "re-queued 20 task(s)" in done.stdout, done.stdout + done.stderr
        assert "1 other category" in done.stdout  # the bad record: invalid_input

        after = await collect(settings, set(first), timeout_s=120, worker=worker,
                              until=lambda g: len(g.results) >= 20)  # fmt: skip
        again = run_cli(settings, "redrive", "--category", "upstream_error")
        status = run_cli(settings, "status", "r-007")
    finally:
        worker.stop()
    assert sorted(r["task_id"] for r in after.results) == [t["task_id"] for t in tasks]
    assert all(r["attempts"] == 1 for r in after.results)
    assert "re-queued 0 task(s)" in again.stdout and "20 answered" in again.stdout
    assert status.returncode == 0
    lines = status.stdout.splitlines()
    assert any(ln.startswith("status") and "succeeded" in ln for ln in lines), status.stdout
    assert status.stdout.index("dead_lettered") < status.stdout.rindex("succeeded")  # history
