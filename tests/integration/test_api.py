"""The Python API answers a task as the worker does: same result key, same output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.api import Analyzer
from streams.contract.records import Source
from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import WorkerProcess, collect, produce

pytestmark = pytest.mark.integration


async def test_the_python_api_answers_a_task_as_the_worker_does(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k",
                                  "model": "sim-1"})  # fmt: skip
    tasks = [{"task_id": f"api-{i}", "pipeline": "comment-analysis",
              "input": {"text": text}}
             for i, text in enumerate(["Great blender, quiet and strong.",
                                       "The lid cracked on day two. Refund please.",
                                       "质量很好，非常满意！"])]  # fmt: skip
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        offsets = await produce(settings, [(t["task_id"].encode(), orjson.dumps(t))
                                           for t in tasks])  # fmt: skip
        got = await collect(settings, set(offsets), timeout_s=120, worker=worker)
    finally:
        worker.stop()
    by_task = {r["task_id"]: r for r in got.results}
    assert set(by_task) == {t["task_id"] for t in tasks}, got.dead_letters

    async with Analyzer(settings) as analyzer:
        for task, (partition, offset) in zip(tasks, offsets, strict=True):
            source = Source(topic=settings.topics.tasks, partition=partition, offset=offset)
            outcome = await analyzer.analyze(task, key=task["task_id"].encode(), source=source)
            worker_result = by_task[task["task_id"]]
            assert outcome.kind == "result"
            assert outcome.key == worker_result["result_key"]
            assert outcome.record()["output"] == worker_result["output"]
            assert outcome.record()["source"] == worker_result["source"]
