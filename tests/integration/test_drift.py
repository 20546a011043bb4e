"""Output drift on real Kafka: a baseline saved from the first answers, then the
simulator's labels shift; the worker's divergence series rises above 0.15 and the
alert rule of deploy/prometheus/rules.yml, evaluated on the scraped series, fires."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from streams.dev.simulator import SimulatorServer
from tests.integration.helpers import Scrape, WorkerProcess, collect, produce, run_cli
from tests.promql import firing

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MOODS = ["Great blender, I love it.", "Broke after a week, terrible.",
         "It is a blender.", "Love the colour but the lid broke."]  # fmt: skip


def rule(name: str) -> str:
    spec = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    (found,) = [r for g in spec["groups"] for r in g["rules"] if r.get("alert") == name]
    return str(found["expr"])


def tasks(prefix: str, n: int) -> list[tuple[bytes, bytes]]:
    return [(f"{prefix}-{i}".encode(), orjson.dumps({
        "task_id": f"{prefix}-{i}", "pipeline": "comment-analysis",
        "input": {"text": f"{MOODS[i % 4]} Order {prefix}-{i}."}})) for i in range(n)]  # fmt: skip


async def scrape_until(worker: WorkerProcess, ok: Any, timeout_s: float = 30) -> Scrape:
    """Scrapes until `ok(scrape)` (the worker reads the baselines every second here)."""
    for _ in range(int(timeout_s * 2)):
        got = await worker.scrape()
        if ok(got):
            return got
        await asyncio.sleep(0.5)
    return got


async def test_a_label_shift_raises_the_divergence_and_fires_the_rule(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        drift={"window": 200, "refresh_s": 1},
    )  # fmt: skip
    drift_rule = rule("LLMStreamsOutputDrift")
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        offsets = await produce(settings, tasks("before", 200))
        await collect(settings, set(offsets), timeout_s=120, worker=worker)
        saved = run_cli(settings, "drift", "--pipeline", "comment-analysis", "--save-baseline")
        assert saved.returncode == 0, saved.stderr
        assert "saved as comment-analysis v1's baseline" in saved.stdout

        def judged(s: Scrape) -> bool:
            return s.has("llm_streams_drift_divergence")

        steady = await scrape_until(worker, judged)
        # The window is the baseline: no divergence, nothing fires.
        psi = steady.value("llm_streams_drift_divergence", field="sentiment", measure="psi")
        assert judged(steady) and psi < 0.01
        assert firing(drift_rule, steady.samples) == []

        # The model drifts: 90% of its answers now say negative, whatever the comment.
        simulator.sim.config.update({"shift_fields": {"sentiment": "negative"},
                                     "shift_rate": 0.9})  # fmt: skip
        offsets = await produce(settings, tasks("after", 200))
        await collect(settings, set(offsets), timeout_s=120, worker=worker)
        shifted = await worker.scrape()
    finally:
        worker.stop()
    negative = shifted.value("llm_streams_drift_share", field="sentiment", value="negative")
    assert negative > 0.85
    psi = shifted.value("llm_streams_drift_divergence", field="sentiment", measure="psi")
    assert psi > 0.15
    fired = firing(drift_rule, shifted.samples)
    assert {(f["field"], f["measure"]) for f in fired} >= {("sentiment", "psi")}
    assert all(f["pipeline"] == "comment-analysis" and f["version"] == "v1" for f in fired)

    report = run_cli(settings, "drift", "--pipeline", "comment-analysis", "--window", "200")
    assert report.returncode == 0, report.stderr
    (row,) = [line for line in report.stdout.splitlines() if "sentiment" in line]
    assert "DRIFT" in row and "negative" in row
