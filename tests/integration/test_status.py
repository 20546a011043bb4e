"""The worker's live status: the web page, loaded in headless Chromium, and the terminal
view show the numbers /metrics has."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest

from streams.dev.simulator import SimulatorServer
from streams.settings import settings_env
from tests.integration.helpers import WorkerProcess, collect, produce
from tests.prerequisites import browser

pytestmark = [pytest.mark.integration, pytest.mark.browser]


def _chromium() -> str:
    found = browser()
    assert found, "no Chromium: the session's prerequisite check should have said so"
    return found


def _look(
    base: str, browser: str, env: dict[str, str]
) -> tuple[Any, subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """The JSON, the page as Chromium renders it, and the terminal view, one after another."""
    with urllib.request.urlopen(f"{base}/status.json", timeout=10) as response:
        snap = orjson.loads(response.read())
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--dump-dom", f"{base}/status"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    view = subprocess.run(
        [sys.executable, "-m", "streams.cli", "status", "--once", "--url", f"{base}/status.json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return snap, dom, view


async def test_the_status_page_and_view_agree_with_the_metrics(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    browser = _chromium()
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"})
    tasks = [{"task_id": f"s-{i}", "pipeline": "comment-analysis",
              "input": {"text": f"Comment {i}: the hinge broke."}} for i in range(20)]  # fmt: skip
    records: list[tuple[bytes | None, bytes | None]] = [
        (t["task_id"].encode(), orjson.dumps(t)) for t in tasks
    ]
    records += [(f"bad-{i}".encode(), b"{oops") for i in range(5)]
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        offsets = await produce(settings, records)
        await collect(settings, set(offsets), timeout_s=120, worker=worker)
        metrics = await worker.scrape()
        base = f"http://127.0.0.1:{worker.web_port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_STREAMS_")}
        env.update(settings_env(settings))
        snap, dom, view = await asyncio.to_thread(_look, base, browser, env)
    finally:
        worker.stop()

    results = metrics.value("llm_streams_tasks_completed_total", outcome="result")
    dead = metrics.value("llm_streams_tasks_completed_total", outcome="dead_letter")
    cost = metrics.value("llm_streams_cost_usd_total")
    assert (results, dead) == (20, 5) and cost > 0
    assert snap["tasks"]["results"] == results and snap["tasks"]["dead_letters"] == dead
    assert snap["cost_usd"] == pytest.approx(cost)
    assert snap["dead_letters_by_category"] == {"invalid_input": 5}

    assert dom.returncode == 0, dom.stderr[-2000:]
    shown = dict(re.findall(r'data-metric="([^"]+)">([^<]*)<', dom.stdout))
    assert shown, dom.stdout[:2000]
    assert float(shown["results"]) == results and float(shown["dead_letters"]) == dead
    assert float(shown["dlq_invalid_input"]) == 5
    assert float(shown["cost_usd"]) == pytest.approx(cost, rel=1e-4)
    assert float(shown["e2e_p95"]) > 0

    assert view.returncode == 0, view.stderr
    assert "25 / 20 / 5" in view.stdout and "invalid_input: 5" in view.stdout
