"""What `/readyz` says, from what the worker knows."""

from __future__ import annotations

from streams.observability.health import Readiness, open_breakers
from streams.observability.metrics import Metrics


def test_ready_only_when_joined_loaded_and_no_breaker_open() -> None:
    assert Readiness(True, (0, 1), (), ()).ready
    assert Readiness(True, (), (), ()).ready  # no partition: stands by
    waiting = Readiness(False, (), (), ())
    assert not waiting.ready and "rebalance" in waiting.reasons()[0]
    loading = Readiness(True, (0, 1), (1,), ())
    assert not loading.ready and loading.reasons() == ["loading the task store of partition(s) [1]"]
    refused = Readiness(True, (0,), (), ("http://llm/v1",))
    assert not refused.ready and "breaker open for http://llm/v1" in refused.reasons()[0]
    assert refused.as_json()["ready"] is False and refused.as_json()["partitions"] == [0]
    standing_by = Readiness(True, (0,), (), (), standby=(1, 2))  # followed, not owned
    assert standing_by.ready and standing_by.as_json()["standby"] == [1, 2]
    full = Readiness(True, (0,), (), (), disk_refusing=True)
    assert not full.ready and "disk refuses its writes" in full.reasons()[0]
    assert full.as_json()["disk_refusing"] is True


def test_open_breakers_are_read_from_the_metrics() -> None:
    metrics = Metrics()
    assert open_breakers(metrics) == ()
    metrics.breaker_state.labels("a").set(2)
    metrics.breaker_state.labels("b").set(1)  # half-open: probes go through
    metrics.breaker_state.labels("c").set(0)
    assert open_breakers(metrics) == ("a",)


def test_a_deployments_open_breaker_keeps_the_worker_ready_while_another_serves_its_model() -> None:
    metrics = Metrics()
    for name in ("east", "west"):
        metrics.watch_deployment(name, "gpt-4o-mini", lambda: (60.0, None))
        metrics.breaker_changed(name, "closed")
    metrics.breaker_changed("east", "open")
    assert open_breakers(metrics) == ()  # west still serves the model
    metrics.breaker_changed("west", "half_open")
    assert open_breakers(metrics) == ()  # west is probing: its calls may go
    metrics.breaker_changed("west", "open")
    assert open_breakers(metrics) == ("east", "west")  # the model has no deployment left
