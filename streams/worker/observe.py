"""What a record's run tells the outside: its span (continuing the producer's trace from
the W3C `traceparent` header) and, once it ended, its metrics, its output to the drift
monitor, and a line for a dead letter."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.trace import Status as SpanStatus

from streams.contract.records import Source
from streams.core.decide import Ended
from streams.core.drift import DriftMonitor
from streams.core.outcome import Outcome
from streams.observability.metrics import Metrics
from streams.observability.tracing import TRACER, context_from_headers

log = logging.getLogger(__name__)


@contextmanager
def record_span(message: Any, lane: str) -> Iterator[Span]:
    """The span of one record's run, a consumer span of the messaging conventions."""
    with TRACER.start_as_current_span(
        f"process {message.topic}",
        context=context_from_headers(message.headers),
        kind=SpanKind.CONSUMER,
        attributes={
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.destination.name": message.topic,
            "messaging.destination.partition.id": str(message.partition),
            "messaging.kafka.offset": message.offset,
            "llm_streams.task_id": message.key.decode(errors="replace") if message.key else "",
            "llm_streams.lane": lane,
        },
    ) as span:
        yield span


def record_ended(
    metrics: Metrics,
    drift: DriftMonitor | None,
    span: Span,
    *,
    lane: str,
    kind: Ended,
    outcome: Outcome | None,
    source: Source,
    timestamp: float | None,
) -> None:
    """A run ended as `kind`, with `outcome` written (None: nothing written here)."""
    span.set_attribute("llm_streams.outcome", kind)
    if outcome is not None and outcome.category is not None:
        span.set_attribute("error.type", outcome.category)
        span.set_status(SpanStatus(StatusCode.ERROR, outcome.category))
    metrics.tasks_completed.labels(lane, kind).inc()
    if outcome is not None and outcome.version is not None and outcome.pipeline:
        metrics.evaluated(
            outcome.pipeline, outcome.version, outcome.verdict,
            seconds=outcome.latency_ms / 1000, prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens, cost_usd=outcome.cost_usd,
            reviewed=bool(outcome.review),
        )  # fmt: skip
        if drift is not None and outcome.output is not None and not outcome.cached:
            drift.observe(outcome.pipeline, outcome.version, outcome.output)
    if outcome is not None and outcome.category is not None:
        error = outcome.error or {"category": outcome.category}
        metrics.dead_letter_written(outcome.task_id, error)
        log.info(
            "dead letter %s/%s after %d attempt(s) for %s/%d/%d: %s",
            error.get("category"), error.get("code"), outcome.attempts,
            source.topic, source.partition, source.offset, error.get("message"),
        )  # fmt: skip
    if timestamp:  # seconds since the epoch, set by the producer or broker
        metrics.end_to_end.labels(lane, kind).observe(max(0.0, time.time() - timestamp))


__all__ = ["record_ended", "record_span"]
