"""The series a worker serves besides its own: who it is, its process; not the noise."""

from __future__ import annotations

from streams.observability.metrics import Metrics


def test_metrics_carry_build_info_and_process_series_and_no_created_noise() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    metrics = Metrics()
    metrics.tasks_received.labels("live").inc()
    text = metrics.render().decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "llm_streams_tasks_received_total" in names
    assert not [n for n in names if n.endswith("_created")]
    assert "process_cpu_seconds_total" in names and "process_resident_memory_bytes" in names
    (build,) = [s for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "llm_streams_build_info"]  # fmt: skip
    assert build.value == 1 and build.labels["version"] and build.labels["faust"] == "0.15.3"


def test_a_breakers_state_is_a_label_with_one_state_set_at_a_time() -> None:
    metrics = Metrics()
    metrics.breaker_changed("sim", "open")
    metrics.breaker_changed("sim", "half_open")

    def value(state: str) -> float | None:
        return metrics.registry.get_sample_value(
            "llm_streams_breaker", {"endpoint": "sim", "state": state})  # fmt: skip

    assert (value("closed"), value("half_open"), value("open")) == (0, 1, 0)
    assert metrics.registry.get_sample_value("llm_streams_breaker_state", {"endpoint": "sim"}) == 1
    assert metrics.breaker_since["sim"] > 0
