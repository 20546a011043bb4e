"""The live status figures, from a worker's own registry."""

from __future__ import annotations

import asyncio

import pytest

from streams.contract.lanes import Lane
from streams.core.budget import Budgets
from streams.observability.metrics import Metrics
from streams.observability.page import count, render_html, seconds, usd
from streams.observability.status import StatusView, histogram_quantile
from streams.pipelines.specs import BudgetSpec, Caps
from streams.resilience.clock import FakeClock


def test_quantiles_interpolate_within_buckets_like_prometheus() -> None:
    buckets = [(0.1, 10.0), (0.5, 60.0), (1.0, 90.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (40 / 50))
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.99, buckets) == 1.0  # in +Inf: the last finite bound
    assert histogram_quantile(0.5, [(float("inf"), 0.0)]) is None


def test_the_snapshot_adds_up_the_registry() -> None:
    metrics = Metrics()
    clock = [100.0]
    view = StatusView(metrics, clock=lambda: clock[0])
    for _ in range(8):
        metrics.tasks_completed.labels("live", "result").inc()
        metrics.end_to_end.labels("live", "result").observe(0.3)
    metrics.tasks_completed.labels("replay", "dead_letter").inc(2)
    metrics.dead_letters.labels("invalid_input").inc(2)
    metrics.cost.labels("p", "m", "sync").inc(0.04)
    metrics.breaker_changed("sim", "open")
    first = view.snapshot()
    assert first["tasks"]["results"] == 8 and first["tasks"]["dead_letters"] == 2
    assert first["cost_usd"] == pytest.approx(0.04)
    assert first["cost_per_result_usd"] == pytest.approx(0.005)
    assert first["dead_letters_by_category"] == {"invalid_input": 2}
    assert first["breakers"] == {"sim": "open"}
    assert 0.25 <= first["end_to_end_s"]["p50"] <= 0.5
    # Throughput between two looks 10 s apart.
    clock[0] += 10
    metrics.tasks_completed.labels("live", "result").inc(20)
    assert view.snapshot()["throughput_per_s"] == pytest.approx(2.0)
    page = render_html(view.snapshot())
    assert 'data-metric="results" data-value="28.0">28<' in page
    assert 'data-metric="breaker_sim">open' in page
    assert 'data-metric="cost_usd" data-value="0.04">$0.0400<' in page


def test_the_history_charts_what_changed_between_samples() -> None:
    metrics = Metrics()
    clock = [0.0]
    view = StatusView(metrics, clock=lambda: clock[0])
    view.sample()
    for minute in range(1, 4):
        clock[0] += 60
        for _ in range(120 * minute):  # 2, 4, 6 tasks/s
            metrics.tasks_completed.labels("live", "result").inc()
            metrics.end_to_end.labels("live", "result").observe(0.2 * minute)
        metrics.cost.labels("p", "m", "sync").inc(0.01 * minute)
        view.sample()
    history = view.snapshot()["history"]
    assert [p["throughput_per_s"] for p in history] == [2.0, 4.0, 6.0]
    assert [p["cost_per_min_usd"] for p in history] == pytest.approx([0.01, 0.02, 0.03])
    assert [p["ago_s"] for p in history] == [120.0, 60.0, 0.0]
    # Each interval's own tasks: 0.2 s, then 0.4 s, then 0.6 s.
    assert 0.1 < history[0]["e2e_p50_s"] <= 0.25 < history[1]["e2e_p50_s"] <= 0.5
    page = render_html(view.snapshot())
    assert page.count("<polyline") == 5  # throughput, p95 and p50, spend, lag
    assert 'data-metric="chart_throughput" data-value="6.0">6.0/s<' in page


def test_numbers_are_formatted_for_people() -> None:
    assert (count(999), count(12_345), count(2_500_000)) == ("999", "12.3k", "2.5M")
    assert (seconds(0.0123), seconds(2.5), seconds(95)) == ("12 ms", "2.50 s", "1.6 min")
    assert (usd(12.345), usd(0.0123), usd(0.000072), usd(0)) == (
        "$12.35", "$0.0123", "$0.0000720", "$0.00")  # fmt: skip


def test_the_latest_dead_letters_show_their_reason() -> None:
    metrics = Metrics()
    for i in range(25):
        metrics.dead_letter_written(f"t-{i}", {"category": "invalid_input", "code": "not_json",
                                               "message": f"record {i} is not JSON <oops>"})  # fmt: skip
    snap = StatusView(metrics).snapshot()
    shown = snap["recent_dead_letters"]
    assert len(shown) == 20 and shown[0]["task_id"] == "t-24"  # newest first, bounded
    assert snap["dead_letters_by_category"] == {"invalid_input": 25}
    page = render_html(snap)
    assert "record 24 is not JSON &lt;oops&gt;" in page and "t-4<" not in page


async def test_spend_caps_show_each_workers_share_spend_and_waiting_tasks() -> None:
    metrics = Metrics()
    budgets = Budgets(FakeClock(86400.0 * 100), metrics=metrics)
    spec = BudgetSpec(usd_per_day=2.0, replay=Caps(usd_per_hour=0.5))
    (await budgets.hold("p", spec, Lane.REPLAY, estimate=0.1)).settle(0.5)
    waiting = asyncio.ensure_future(budgets.hold("p", spec, Lane.REPLAY, estimate=0.1))
    await asyncio.sleep(0)
    snap = StatusView(metrics).snapshot()
    waiting.cancel()
    assert snap["budgets"] == [
        {"pipeline": "p", "lane": "all", "window": "day", "cap_usd": 2.0, "spent_usd": 0.5,
         "waiting": 1},
        {"pipeline": "p", "lane": "replay", "window": "hour", "cap_usd": 0.5, "spent_usd": 0.5,
         "waiting": 1},
    ]  # fmt: skip
    page = render_html(snap)
    assert 'data-metric="budget_p_replay_hour" data-value="0.5"' in page
    assert "1 waiting" in page


def test_the_page_says_who_the_worker_is_and_what_the_llm_and_lanes_did() -> None:
    """Worker identity, LLM calls/429s/errors/retries by category, per-lane rows, and
    an open breaker with the time it opened and what to do."""
    metrics = Metrics()
    clock = [0.0]
    identity = {"host": "w-0", "app_id": "shop", "model": "gpt-4o-mini",
                "endpoint": "http://llm:8000/v1", "pipelines": ["comment-analysis"],
                "partitions": [0, 3], "guarantee": "exactly_once"}  # fmt: skip
    view = StatusView(metrics, clock=lambda: clock[0], identity=lambda: identity)
    metrics.llm_requests.labels("m", "ok", "").inc(40)
    metrics.llm_requests.labels("m", "error", "rate_limited").inc(7)
    metrics.llm_requests.labels("m", "error", "upstream_error").inc(3)
    metrics.retries.labels("rate_limited").inc(6)
    metrics.tasks_received.labels("live").inc(30)
    metrics.tasks_received.labels("replay").inc(12)
    metrics.tasks_completed.labels("live", "result").inc(28)
    metrics.tasks_completed.labels("live", "dead_letter").inc(1)
    metrics.tasks_completed.labels("replay", "result").inc(12)
    metrics.end_to_end.labels("live", "result").observe(0.4)
    metrics.breaker_changed("sim", "open")
    clock[0] += 125
    snap = view.snapshot()
    assert snap["llm"] == {"ok": 40, "rate_limited": 7,
                           "errors": {"rate_limited": 7, "upstream_error": 3},
                           "retries": {"rate_limited": 6}}  # fmt: skip
    lanes = {r["lane"]: r for r in snap["lanes"]}
    assert (lanes["live"]["received"], lanes["live"]["results"],
            lanes["live"]["dead_letters"]) == (30, 28, 1)  # fmt: skip
    assert lanes["replay"]["results"] == 12 and lanes["replay"]["e2e_p95_s"] is None
    assert snap["worker"]["host"] == "w-0" and snap["worker"]["uptime_s"] == 125.0
    assert snap["worker"]["version"]  # from llm_streams_build_info
    page = render_html(snap)
    for shown in ("data-metric='worker_host'>w-0<", "data-metric='worker_partitions'>0,3<",
                  "data-metric='worker_endpoint'>http://llm:8000/v1<",
                  'data-metric="llm_rate_limited" data-value="7">7<',
                  'data-metric="llm_errors_upstream_error" data-value="3">3<',
                  'data-metric="llm_retries_rate_limited" data-value="6">6<',
                  'data-metric="lane_replay_results" data-value="12">12<'):  # fmt: skip
        assert shown in page, shown
    assert "breaker sim: " in page and " since " in page
    assert "data-metric='hint_sim'" in page and "OPERATIONS.md#llmstreamsbreakeropen" in page


def test_figures_say_their_window_and_the_time_axis_fits_the_history() -> None:
    metrics = Metrics()
    clock = [0.0]
    view = StatusView(metrics, clock=lambda: clock[0])
    view.sample()
    for _ in range(3):  # 5 minutes of history, not an hour
        clock[0] += 100
        metrics.tasks_completed.labels("live", "result").inc(50)
        view.sample()
    view.snapshot()
    clock[0] += 30
    page = render_html(view.snapshot())
    assert "throughput (last 30.00 s)" in page
    assert "end-to-end p95 since start" in page and "spent since start" in page
    assert "Spend, USD per minute" in page and "Last 4 min" in page
    assert page.count('data-span-s="230"') == 4  # the oldest point, 230 s ago
    assert ">−4 min</text>" in page and "−60 min" not in page
    # Live without a reload: the script swaps the body; a meta refresh only without script.
    assert "<noscript><meta http-equiv='refresh'" in page and "DOMParser" in page
    assert "name='viewport'" in page


def test_the_terminal_view_says_who_the_worker_is_and_what_the_llm_did() -> None:
    from rich.console import Console

    from streams.cli.live import table

    metrics = Metrics()
    view = StatusView(metrics, identity=lambda: {"host": "w-1", "app_id": "shop",
                                                 "partitions": [], "model": "m"})  # fmt: skip
    metrics.llm_requests.labels("m", "ok", "").inc(9)
    metrics.llm_requests.labels("m", "error", "timeout").inc(2)
    console = Console(width=200, record=True)
    console.print(table(view.snapshot(), "http://w-1:6066/status.json"))
    text = console.export_text()
    assert "w-1 · shop" in text and "partitions none" in text
    assert "9 ok / 0 429; errors timeout: 2; retries none" in text
