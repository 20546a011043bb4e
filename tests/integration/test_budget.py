"""A pipeline's spend cap on a worker against Apache Kafka: reached mid-run, its lane's
records wait unacked (no dead letter), a SIGKILL at the cap loses none of them and its
successor goes on counting from the spend saved, and the cap raised with `llm-streams
budget` while the worker runs lets the rest go on, each task answered once and paid once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import (
    WorkerProcess,
    assert_each_task_answered_once,
    collect,
    committed,
    produce,
    run_cli,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TASKS = 30
CAP_USD = 2.0  # ~$0.3 a task at $1 per 1k tokens: a handful are answered, then it waits


def _pipelines(folder: Path, usd_per_day: float) -> Path:
    folder.mkdir(exist_ok=True)
    for path in (ROOT / "pipelines").glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())
        if spec["name"] == "comment-analysis":
            spec["budget"] = {"usd_per_day": usd_per_day}
        (folder / path.name).write_text(yaml.safe_dump(spec))
    return folder


async def _tasks_within_one_day(prefix: str) -> list[dict[str, Any]]:
    """The tasks of a run, once it cannot cross a UTC day's end (the caps are per day)."""
    to_midnight = 86400 - time.time() % 86400
    if to_midnight < 120:
        await asyncio.sleep(to_midnight + 1)
    return [{"task_id": f"{prefix}-{i}", "pipeline": "comment-analysis",
             "input": {"text": f"Order {i}: the kettle boils fast, but the lid squeaks."}}
            for i in range(TASKS)]  # fmt: skip


async def _waiting_at_the_cap(
    worker: WorkerProcess, timeout_s: float = 60, capped: str = "comment-analysis"
) -> float:
    """Once tasks wait at the cap and no other task runs: the worker's spend so far under
    the cap of `capped` (a pipeline, or `deployment:NAME`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert worker.alive(), worker.log_tail()
        try:
            scrape = await worker.scrape()
        except OSError:  # its web server not up yet
            await asyncio.sleep(0.5)
            continue
        waiting = scrape.value("llm_streams_budget_waiting_tasks", pipeline="comment-analysis")
        running = scrape.value("llm_streams_tasks_in_flight")  # the waiting ones among them
        if waiting > 0 and running == waiting:
            return scrape.value("llm_streams_budget_spent_usd", pipeline=capped, lane="all",
                                window="day")  # fmt: skip
        await asyncio.sleep(0.5)
    raise AssertionError(f"no task waits at the cap:\n{worker.log_tail()}")


async def _at_the_cap(settings: Any, worker: WorkerProcess) -> tuple[int, float]:
    """The worker waits at the cap: the tasks answered (none dead-lettered, the rest
    unacked) and the worker's spend."""
    spent = await _waiting_at_the_cap(worker)
    got = await collect(settings, set(), timeout_s=3, settle_s=0)
    answered = len({r["task_id"] for r in got.results})
    assert 0 < answered < TASKS and not got.dead_letters
    # It stopped within a task's cost of the cap (a task alone under the cap goes).
    assert CAP_USD <= spent < CAP_USD + max(r["cost_usd"] for r in got.results)
    assert await committed(settings) <= answered  # the waiting records: unacked
    log = worker.log_path.read_text()
    assert "wait at its spend cap" in log
    assert "Updating subscribed topics" not in log  # the sync every second says nothing
    return answered, spent


async def test_a_spend_cap_holds_records_back_a_crash_loses_none_and_a_raise_lets_them_go(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1",
             "price_per_1k_prompt_usd": 1.0, "price_per_1k_completion_usd": 1.0},
        pipelines_dir=_pipelines(tmp_path / "pipelines", CAP_USD),
        budget={"refresh_s": 1},
    )  # fmt: skip
    tasks = await _tasks_within_one_day("b")
    first = WorkerProcess(settings, tmp_path / "worker-1.log").start()
    try:
        await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
        answered, spent = await _at_the_cap(settings, first)
        await asyncio.sleep(3)  # its spend saved (every budget.refresh_s)
        first.kill()  # at the cap: its waiting records were never acked
    finally:
        first.stop()
    # A new worker goes on counting from the spend saved: at the cap at once, it answers
    # nothing new — and nothing of the first one's is lost or asked again.
    second = WorkerProcess(settings, tmp_path / "worker-2.log").start()
    try:
        again, counted = await _at_the_cap(settings, second)
        assert again == answered and counted == pytest.approx(spent)
        raised = run_cli(settings, "budget", "comment-analysis", "--usd-per-day", "1000")
        assert raised.returncode == 0, raised.stderr
        assert "spend caps now $1000/day (set;" in raised.stdout
        got = await collect(settings, set(), timeout_s=120, worker=second,
                            until=lambda c: len({r["task_id"] for r in c.results}) >= TASKS)  # fmt: skip
        assert second.alive()  # the raise reached it while it ran
        assert_each_task_answered_once(got, {t["task_id"] for t in tasks})
        assert not got.dead_letters
        assert simulator.sim.snapshot()["requests"] == TASKS  # nothing paid twice
        shown = run_cli(settings, "budget", "comment-analysis")
        assert "spend caps $1000/day (set " in shown.stdout, shown.stdout + shown.stderr
        assert f"its file says: ${CAP_USD:g}/day" in shown.stdout
    finally:
        second.stop()


async def test_a_deployments_spend_cap_holds_its_models_tasks_and_a_raise_lets_them_go(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    """The deployments file's cap of a model's only deployment: reached, the model's
    records wait unacked (no dead letter); raised with `llm-streams budget
    deployment:NAME` while the worker runs, the rest go on, each answered once."""
    deployments = tmp_path / "deployments.yaml"
    deployments.write_text(yaml.safe_dump({"deployments": [
        {"name": "solo", "model": "sim-1", "base_url": simulator.base_url,
         "price_per_1k_prompt_usd": 1.0, "price_per_1k_completion_usd": 1.0,
         "usd_per_day": CAP_USD}]}))  # fmt: skip
    settings = make_settings(
        llm={"base_url": "http://127.0.0.1:1/v1", "api_key": "k", "model": "sim-1",
             "deployments_file": deployments},
        budget={"refresh_s": 1},
    )  # fmt: skip
    tasks = await _tasks_within_one_day("d")
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        await produce(settings, [(t["task_id"].encode(), orjson.dumps(t)) for t in tasks])
        spent = await _waiting_at_the_cap(worker, capped="deployment:solo")
        got = await collect(settings, set(), timeout_s=3, settle_s=0)
        answered = len({r["task_id"] for r in got.results})
        assert 0 < answered < TASKS and not got.dead_letters
        # It stopped within a task's cost of the cap (a task alone under the cap goes).
        assert CAP_USD <= spent < CAP_USD + max(r["cost_usd"] for r in got.results)
        assert await committed(settings) <= answered  # the waiting records: unacked
        assert "deployment solo: at its spend cap" in worker.log_path.read_text()
        refused = run_cli(settings, "budget", "deployment:nowhere", "--usd-per-day", "5")
        assert refused.returncode == 2 and "no deployment named 'nowhere'" in refused.stderr
        raised = run_cli(settings, "budget", "deployment:solo", "--usd-per-day", "1000")
        assert raised.returncode == 0, raised.stderr
        assert "spend caps now $1000/day (set;" in raised.stdout
        got = await collect(settings, set(), timeout_s=120, worker=worker,
                            until=lambda c: len({r["task_id"] for r in c.results}) >= TASKS)  # fmt: skip
        assert worker.alive()
        assert_each_task_answered_once(got, {t["task_id"] for t in tasks})
        assert not got.dead_letters
        assert simulator.sim.snapshot()["requests"] == TASKS  # nothing paid twice
        shown = run_cli(settings, "budget", "deployment:solo")
        assert f"its file says: ${CAP_USD:g}/day" in shown.stdout, shown.stdout + shown.stderr
    finally:
        worker.stop()
