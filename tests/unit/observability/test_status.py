"""The live status figures, from a worker's own registry."""

from __future__ import annotations

import pytest

from streams.observability.metrics import Metrics
from streams.observability.status import StatusView, histogram_quantile, render_html


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
    assert '<td data-metric="results">28</td>' in page and 'data-metric="breaker_sim">open' in page
