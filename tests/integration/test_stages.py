"""A two-stage pipeline on a worker: stage 2 fails for a while; the dead letters keep
stage 1's answers in the task state, and a redrive resumes from stage 2 (no new call
for stage 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import WorkerProcess, collect, produce, run_cli

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _pipelines(tmp_path: Path) -> Path:
    """The shipped pipelines, with stage 2 (reply-draft) on its own model."""
    folder = tmp_path / "pipelines"
    folder.mkdir()
    for path in (ROOT / "pipelines").glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())
        if spec["name"] == "reply-draft":
            spec["versions"]["v1"]["model"] = "gpt-4o-mini"
        (folder / path.name).write_text(yaml.safe_dump(spec))
    return folder


async def test_a_failed_stage_is_redriven_from_itself(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    simulator.sim.config.error_500_models = ["gpt-4o-mini"]  # stage 2's model is down
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1",
             "max_attempts": 2, "backoff_base_s": 0.01, "backoff_max_s": 0.05},
        resilience={"breaker_min_calls": 10_000},
        pipelines_dir=_pipelines(tmp_path),
    )  # fmt: skip
    unhappy = [{"task_id": f"u-{i}", "pipeline": "comment-triage",
                "input": {"text": f"Order {i}: the lid broke and the box was crushed. Terrible."}}
               for i in range(10)]  # fmt: skip
    happy = [{"task_id": f"h-{i}", "pipeline": "comment-triage",
              "input": {"text": f"Order {i}: great kettle, I love it."}} for i in range(5)]  # fmt: skip
    tasks = unhappy + happy
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        offsets = await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
        got = await collect(settings, set(offsets), timeout_s=120, worker=worker)
        assert {r["task_id"] for r in got.results} == {t["task_id"] for t in happy}
        assert all(r["output"]["stages"] == {"reply": None} for r in got.results)
        assert {d["task_id"] for d in got.dead_letters} == {t["task_id"] for t in unhappy}
        for d in got.dead_letters:
            assert d["error"]["category"] == "upstream_error"
            assert d["error"]["message"].startswith("stage reply: ")
        calls = simulator.sim.snapshot()["requests"]
        assert calls == len(tasks) + 2 * len(unhappy)  # stage 1 each, stage 2 twice (retry)

        shown = run_cli(settings, "status", "u-3")
        assert shown.returncode == 0, shown.stderr
        assert "dead_lettered" in shown.stdout and "reply" in shown.stdout

        simulator.sim.config.error_500_models = []  # stage 2's model is back
        done = run_cli(settings, "redrive", "--category", "upstream_error")
        assert "re-queued 10 task(s)" in done.stdout, done.stdout + done.stderr
        again = await collect(settings, set(), timeout_s=120, worker=worker,
                              until=lambda c: len(c.results) >= len(tasks))  # fmt: skip
        redriven = [r for r in again.results if r["task_id"].startswith("u-")]
        assert {r["task_id"] for r in redriven} == {t["task_id"] for t in unhappy}
        for r in redriven:
            assert r["output"]["sentiment"] == "negative"
            assert set(r["output"]["stages"]["reply"]) == {"reply", "tone", "escalate"}
        # Resumed from stage 2: one call per task, none for stage 1 again.
        assert simulator.sim.snapshot()["requests"] - calls == len(unhappy)
    finally:
        worker.stop()
