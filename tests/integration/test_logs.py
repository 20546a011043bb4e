"""A full run at debug level with a known API key and comments full of personal data:
neither the key nor any of the data appears anywhere in the worker's output, and its
JSON log lines carry the task they were written for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import WorkerProcess, collect, produce

pytestmark = pytest.mark.integration

KEY = "sk-proj-LEAKCHECK-7f3a9c0e51d24b86"
PII = ["wang.fang@example.com", "13912345678", "11010519491231002X", "6011 0009 9013 9424",
       "+44 20 7946 0958"]  # fmt: skip


async def test_no_key_and_no_personal_data_in_the_logs(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    simulator.sim.config.malformed_rate = 0.3  # repairs and dead letters: more log lines
    simulator.sim.config.error_500_rate = 0.2
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": KEY, "model": "sim-1", "max_attempts": 2,
             "backoff_base_s": 0.01, "backoff_max_s": 0.05},
        resilience={"breaker_min_calls": 10_000},
        log_level="debug", log_format="json",
    )  # fmt: skip
    tasks = [{"task_id": f"p-{i}", "pipeline": "comment-analysis",
              "input": {"text": f"Broken again (#{i}). Call me: {PII[i % len(PII)]} or mail "
                                f"{PII[0]}; card {PII[3]}, ID {PII[2]}."}}
             for i in range(30)]  # fmt: skip
    log_path = tmp_path / "worker.log"
    worker = WorkerProcess(settings, log_path).start()
    try:
        offsets = await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
        got = await collect(settings, set(offsets), timeout_s=120, worker=worker)
    finally:
        worker.stop()
    assert len(got.results) + len(got.dead_letters) == len(tasks)
    assert got.dead_letters, "the faults should have produced some dead letters to log"
    text = log_path.read_text(errors="replace")
    assert len(text) > 50_000  # debug level: the SDK, aiokafka and Faust all talked
    assert KEY not in text
    leaked = [p for p in PII if p in text]
    assert not leaked, leaked
    entries = [orjson.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert len(entries) > 100
    with_task = {e["task_id"] for e in entries if e.get("task_id")}
    assert with_task and with_task <= {t["task_id"] for t in tasks}
    assert any(e["message"].startswith("dead letter ") and e["task_id"] for e in entries)
