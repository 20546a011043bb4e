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
