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


def shown_figures(dom: str) -> dict[str, tuple[str, str]]:
    """Each figure of the page: its raw `data-value` and the text shown."""
    found = re.findall(r'data-metric="([^"]+)"(?: data-value="([^"]*)")?>([^<]*)<', dom)
    return {key: (value, text) for key, value, text in found}


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
        await _layout_and_live_updates(base, browser, settings)
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
    shown = shown_figures(dom.stdout)
    assert shown, dom.stdout[:2000]
    assert float(shown["results"][0]) == results and float(shown["dead_letters"][0]) == dead
    assert shown["results"][1] == "20" and float(shown["dlq_invalid_input"][0]) == 5
    assert float(shown["cost_usd"][0]) == pytest.approx(cost, rel=1e-4)
    assert shown["cost_usd"][1].startswith("$")  # for people: $0.00123, not 1.23e-03
    assert float(shown["e2e_p95"][0]) > 0

    assert view.returncode == 0, view.stderr
    assert "25 / 20 / 5" in view.stdout and "invalid_input: 5" in view.stdout


async def _layout_and_live_updates(base: str, browser: str, settings: Any) -> None:
    """The page's layout, read from Chromium's boxes (layout, not pixels): on a wide
    screen the charts sit side by side; at phone width nothing is wider than the screen,
    the charts stack and the tiles wrap. And it updates in place: new tasks show without
    a reload (a mark set in the page survives)."""
    from tests.browser import Page

    async with Page(browser, 1400, 1000) as wide:
        await wide.open(f"{base}/status")
        charts = await wide.boxes(".chart")
        assert len(charts) == 4
        assert len({round(c["top"]) for c in charts}) < 4, charts  # some share a row
    async with Page(browser, 390, 844, mobile=True) as phone:
        await phone.open(f"{base}/status")
        assert await phone.evaluate("document.documentElement.scrollWidth") <= 390
        for selector in (".tile", ".chart", ".version", "table", "h1", ".who"):
            for box in await phone.boxes(selector):
                assert box["left"] >= 0 and box["right"] <= 390.5, (selector, box)
        charts = await phone.boxes(".chart")
        tops = [c["top"] for c in charts]
        assert len(charts) == 4 and tops == sorted(tops) and len(set(map(round, tops))) == 4
        assert all(c["right"] - c["left"] > 300 for c in charts)  # scaled, not shrunk away
        tiles = await phone.boxes(".tile")
        assert len({round(t["top"]) for t in tiles}) >= 3  # wrapped into rows
        # Live: a mark set in this page survives while the figures change.
        shown = "Number(document.querySelector('[data-metric=received]').dataset.value)"
        before = await phone.evaluate(shown)
        await phone.evaluate("window.__mark = 42")
        more = [(f"live-{i}".encode(), orjson.dumps({
            "task_id": f"live-{i}", "pipeline": "comment-analysis",
            "input": {"text": f"Comment {i}: lovely."}})) for i in range(5)]  # fmt: skip
        await produce(settings, more)
        for _ in range(120):
            if await phone.evaluate(shown) >= before + 5:
                break
            await asyncio.sleep(0.25)
        assert await phone.evaluate(shown) >= before + 5
        assert await phone.evaluate("window.__mark") == 42  # no reload
        assert await phone.evaluate("document.documentElement.dataset.live") == "1"


PASS_FILL = (0x1B, 0x8A, 0x5A)  # streams.observability.page.PASS_FILL
BAR_TRACK = (0xE3, 0xE6, 0xEA)  # streams.observability.page.BAR_TRACK


def bar_fractions(png: Path) -> list[float]:
    """The pass-rate bars of a screenshot, top to bottom: filled width / bar width,
    measured on each bar's middle row."""
    from PIL import Image

    image = Image.open(png).convert("RGB")
    width, height = image.size
    pixels = image.load()
    assert pixels is not None
    bars, y = [], 0
    while y < height:
        row = [pixels[x, y] for x in range(width)]
        fill = [x for x, c in enumerate(row) if c == PASS_FILL]
        track = [x for x, c in enumerate(row) if c == BAR_TRACK]
        if fill or track:
            start = min(fill + track)
            end = max(fill + track)
            # The bar's rows: measure the one in its middle (round corners aside).
            top = y
            while y < height and any(pixels[x, y] in (PASS_FILL, BAR_TRACK)
                                     for x in range(start, end + 1)):  # fmt: skip
                y += 1
            middle = [pixels[x, (top + y) // 2] for x in range(start, end + 1)]
            filled = sum(1 for c in middle if c == PASS_FILL)
            bars.append(filled / len(middle))
        y += 1
    return bars


async def test_the_dashboard_shows_the_figures_of_the_metrics(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    """Charts of the last hour, the latest dead letters with their reason, and a panel
    per prompt version whose pass-rate bar, in a screenshot, is as long as the metrics
    say."""
    browser = _chromium()
    settings = make_settings(llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"})
    simulator.sim.config.update({"malformed_rate": 0.3})  # some first answers fail the checks
    records: list[tuple[bytes | None, bytes | None]] = [
        (f"d-{i}".encode(), orjson.dumps({"task_id": f"d-{i}", "pipeline": "comment-analysis",
                                          "input": {"text": f"Order {i}: the lid broke."}}))
        for i in range(60)
    ]  # fmt: skip
    records.append((b"bad-1", b"{oops"))
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    png = tmp_path / "status.png"
    try:
        offsets = await produce(settings, records)
        await collect(settings, set(offsets), timeout_s=120, worker=worker)
        base = f"http://127.0.0.1:{worker.web_port}"

        def charted() -> bool:
            with urllib.request.urlopen(f"{base}/status.json", timeout=10) as response:
                return bool(orjson.loads(response.read())["history"])

        for _ in range(60):  # two history points (every 10 s) make the first chart point
            if await asyncio.to_thread(charted):
                break
            await asyncio.sleep(0.5)
        metrics = await worker.scrape()
        shot = await asyncio.to_thread(subprocess.run, [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars", f"--screenshot={png}", "--window-size=1400,2400",
            f"{base}/status"], capture_output=True, text=True, timeout=120)  # fmt: skip
        dom = await asyncio.to_thread(subprocess.run, [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--dump-dom", f"{base}/status"], capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        worker.stop()
    verdicts = {v: metrics.value("llm_streams_version_tasks_total", version="v1", verdict=v)
                for v in ("pass", "repaired", "rejected")}  # fmt: skip
    judged = sum(verdicts.values())
    pass_rate = verdicts["pass"] / judged
    assert judged >= 55 and 0.4 < pass_rate < 0.95, verdicts

    assert dom.returncode == 0, dom.stderr[-2000:]
    shown = shown_figures(dom.stdout)
    value, text = shown["version:comment-analysis/v1:pass_rate"]
    assert float(value) == pytest.approx(pass_rate, abs=1e-4)
    assert text == f"{pass_rate:.1%}"
    assert "chart_throughput" in shown and "<polyline" in dom.stdout
    assert "bad-1" in dom.stdout and "invalid_input" in dom.stdout  # the latest dead letter

    assert shot.returncode == 0 and png.exists(), shot.stderr[-2000:]
    bars = bar_fractions(png)
    assert len(bars) == 1, (bars, png)
    (bar,) = bars
    assert bar == pytest.approx(pass_rate, abs=0.01)
