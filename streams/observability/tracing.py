"""OpenTelemetry spans: one per task (continuing the producer's trace from the record's
W3C `traceparent` header), one per stage, one per LLM attempt; the result record carries
the trace id and the trace context goes on in the outcome record's headers.

The official `opentelemetry-instrumentation-openai-v2` wraps `chat.completions.create`;
the adapter posts chat completions itself (see streams/llm/openai_client.py), so the
attempt spans are written here with the GenAI semantic conventions' attribute names
(`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...). Spans are made in the job's
asyncio task (contextvars), not on Faust's consumer thread, so none is orphaned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from streams.errors import StreamsError
from streams.settings import TracingSettings

TRACER = trace.get_tracer("llm-streams")
PROPAGATOR = TraceContextTextMapPropagator()
HEADERS = ("traceparent", "tracestate")


def setup_tracing(settings: TracingSettings) -> None:
    """This process's tracer provider (`tracer_provider`)."""
    trace.set_tracer_provider(tracer_provider(settings))


def tracer_provider(settings: TracingSettings) -> Any:
    """A tracer provider: always (so trace ids exist and propagate), exporting only
    when configured. Without an exporter, a trace begun here is not
    sampled: its spans are the SDK's non-recording ones (ids, no attributes, no
    events: a third of the cost), and the flag says so downstream; a trace sampled
    upstream stays sampled, as its producer asked."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    t = settings
    root = ALWAYS_OFF if t.exporter == "none" else ALWAYS_ON
    provider = TracerProvider(resource=Resource.create({"service.name": t.service_name}),
                              sampler=ParentBased(root))  # fmt: skip
    if t.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif t.exporter == "file":
        if t.file is None:
            raise ValueError("LLM_STREAMS_TRACING__FILE is needed with exporter=file")
        out: TextIO = open(t.file, "a", encoding="utf-8")  # noqa: SIM115  # lives as long as the process
        exporter = ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\n")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def context_from_headers(headers: Any) -> otel_context.Context:
    """The trace context a producer put in a record's headers (or an empty one)."""
    items: Iterable[tuple[str, Any]] = (
        headers.items() if isinstance(headers, dict) else (headers or ())
    )
    carrier: dict[str, str] = {}
    for key, value in items:
        name = key.lower() if isinstance(key, str) else bytes(key).decode(errors="replace")
        if name in HEADERS and value is not None:
            carrier[name] = value.decode(errors="replace") if isinstance(value, bytes) else value
    return PROPAGATOR.extract(carrier, getter=DefaultGetter())


def headers_for(span: Span | None = None) -> list[tuple[str, bytes]]:
    """W3C trace context headers of `span` (default: the current one); none if invalid."""
    ctx = trace.set_span_in_context(span) if span is not None else None
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=ctx)
    return [(k, v.encode()) for k, v in carrier.items()]


def current_trace_id() -> str | None:
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else None


def mark_error(span: Span, exc: StreamsError) -> None:
    """An attempt or stage span that ended in an error of our taxonomy."""
    span.set_attribute("error.type", exc.category.value)
    span.set_attribute("llm_streams.error.code", exc.code)
    span.set_status(Status(StatusCode.ERROR, exc.message[:200]))


def child_span(name: str, **options: Any) -> contextlib.AbstractContextManager[Span]:
    """A span under the current one (`Tracer.start_as_current_span(name, **options)`);
    under a span that records nothing (its trace not sampled), that span itself: a
    child would record nothing either (the sampler follows the parent), and each one
    still costs a sampling decision and a context switch, per stage and per attempt."""
    current = trace.get_current_span()
    if current.get_span_context().is_valid and not current.is_recording():
        return contextlib.nullcontext(current)
    return TRACER.start_as_current_span(name, **options)


@contextlib.contextmanager
def stage_span(stage: str, pipeline: str, version: str) -> Iterator[Span]:
    with child_span(
        f"stage {stage}",
        attributes={"llm_streams.stage": stage, "llm_streams.pipeline": pipeline,
                    "llm_streams.prompt_version": version},
        record_exception=False,
    ) as span:  # fmt: skip
        try:
            yield span
        except StreamsError as exc:
            mark_error(span, exc)
            raise


__all__ = [
    "PROPAGATOR",
    "TRACER",
    "child_span",
    "context_from_headers",
    "current_trace_id",
    "headers_for",
    "mark_error",
    "setup_tracing",
    "stage_span",
    "tracer_provider",
]
