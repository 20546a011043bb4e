"""The worker's tracer provider: trace ids always; spans recorded only when they can
go somewhere, or when the producer sampled the trace."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.trace import TraceFlags

from streams.observability.tracing import PROPAGATOR, context_from_headers, tracer_provider
from streams.settings import load_settings

SAMPLED_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_without_an_exporter_a_trace_begun_here_has_ids_and_records_nothing() -> None:
    tracer = tracer_provider(load_settings().tracing).get_tracer("test")
    with tracer.start_as_current_span("process", attributes={"a": 1}) as span:
        context = span.get_span_context()
        assert context.is_valid  # ids for the result record and the headers
        assert not span.is_recording()
        assert not context.trace_flags & TraceFlags.SAMPLED  # and downstream is told so
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier)
        assert carrier["traceparent"].split("-")[1] == format(context.trace_id, "032x")


def test_without_an_exporter_a_trace_sampled_upstream_stays_sampled() -> None:
    tracer = tracer_provider(load_settings().tracing).get_tracer("test")
    parent = context_from_headers([("traceparent", SAMPLED_PARENT.encode())])
    with tracer.start_as_current_span("process", context=parent) as span:
        assert span.is_recording()
        assert span.get_span_context().trace_flags & TraceFlags.SAMPLED
        assert format(span.get_span_context().trace_id, "032x") == SAMPLED_PARENT.split("-")[1]


def test_with_an_exporter_every_trace_is_recorded(tmp_path: Path) -> None:
    settings = load_settings(tracing={"exporter": "file", "file": str(tmp_path / "spans")})
    tracer = tracer_provider(settings.tracing).get_tracer("test")
    with tracer.start_as_current_span("process") as span:
        assert span.is_recording()
    assert '"name": "process"' in (tmp_path / "spans").read_text()


def test_under_a_span_that_records_nothing_no_child_is_made() -> None:
    from opentelemetry import trace

    from streams.observability.tracing import child_span

    tracer = tracer_provider(load_settings().tracing).get_tracer("test")
    with tracer.start_as_current_span("process") as task_span:
        assert not task_span.is_recording()
        with child_span("chat m") as attempt:
            assert attempt is task_span
            assert trace.get_current_span() is task_span


def test_under_a_recording_span_a_child_is_made(tmp_path: Path) -> None:
    from streams.observability.tracing import child_span

    settings = load_settings(tracing={"exporter": "file", "file": str(tmp_path / "spans")})
    provider = tracer_provider(settings.tracing)
    with provider.get_tracer("test").start_as_current_span("process") as task_span:
        assert task_span.is_recording()
        # (child_span starts it with the process's tracer, not this test's provider:
        # what is checked is that it starts one, not the task's span again.)
        with child_span("chat m") as attempt:
            assert attempt is not task_span
