"""One trace from the producer's span through the worker's task, stage and LLM-attempt
spans to the result record's trace_id and headers (spans exported to a file)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import set_span_in_context

from streams.dev.simulator import SimulatorServer
from streams.kafka.topics import ensure_topics
from streams.observability.tracing import PROPAGATOR
from tests.integration.helpers import WorkerProcess

pytestmark = pytest.mark.integration


async def test_a_trace_runs_from_the_producer_to_the_result(
    make_settings: Any, simulator: SimulatorServer, tmp_path: Path
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    settings = make_settings(
        llm={"base_url": simulator.base_url, "api_key": "k", "model": "sim-1"},
        tracing={"exporter": "file", "file": str(spans_file)},
    )
    # The producer's side: its own tracer, spans kept in memory.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("shop-backend")
    task = {"task_id": f"tr-{uuid.uuid4().hex[:6]}", "pipeline": "comment-triage",
            "input": {"text": "The strap broke after a day and the box was crushed. Terrible."}}  # fmt: skip
    await ensure_topics(settings)
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers)
    await producer.start()
    try:
        with tracer.start_as_current_span("publish comment") as publish:
            carrier: dict[str, str] = {}
            PROPAGATOR.inject(carrier, context=set_span_in_context(publish))
            await producer.send_and_wait(
                settings.topics.tasks, key=task["task_id"].encode(), value=orjson.dumps(task),
                headers=[(k, v.encode()) for k, v in carrier.items()],
            )  # fmt: skip
        consumer = AIOKafkaConsumer(settings.topics.results, bootstrap_servers=settings.bootstrap_servers,
                                    auto_offset_reset="earliest", group_id=f"tr-{uuid.uuid4().hex[:6]}")  # fmt: skip
        await consumer.start()
        try:
            record = await consumer.getone()
        finally:
            await consumer.stop()
    finally:
        await producer.stop()
        worker.stop()
    trace_id = format(publish.get_span_context().trace_id, "032x")
    publish_id = format(publish.get_span_context().span_id, "016x")
    result = orjson.loads(record.value)
    assert result["task_id"] == task["task_id"] and result["trace_id"] == trace_id
    assert dict(record.headers)["traceparent"].decode().split("-")[1] == trace_id

    spans = [orjson.loads(line) for line in spans_file.read_text().splitlines() if line]
    mine = [s for s in spans if s["context"]["trace_id"] == f"0x{trace_id}"]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in mine:
        by_name.setdefault(s["name"], []).append(s)
    (process,) = by_name[f"process {settings.topics.tasks}"]
    assert process["parent_id"] == f"0x{publish_id}" and process["kind"] == "SpanKind.CONSUMER"
    attrs = process["attributes"]
    assert attrs["messaging.system"] == "kafka"
    assert attrs["messaging.destination.name"] == settings.topics.tasks
    assert attrs["llm_streams.task_id"] == task["task_id"]
    assert attrs["llm_streams.prompt_version"] == "v1" and attrs["llm_streams.outcome"] == "result"
    stages = {s["attributes"]["llm_streams.stage"]: s for s in by_name["stage main"]
              + by_name["stage reply"]}  # fmt: skip
    assert {s["parent_id"] for s in stages.values()} == {process["context"]["span_id"]}
    calls = by_name["chat sim-1"]
    assert sorted(c["parent_id"] for c in calls) == sorted(
        s["context"]["span_id"] for s in stages.values()
    )
    for call in calls:
        assert call["kind"] == "SpanKind.CLIENT"
        assert call["attributes"]["gen_ai.request.model"] == "sim-1"
        assert call["attributes"]["gen_ai.usage.input_tokens"] > 0
        assert call["attributes"]["gen_ai.provider.name"] == "openai"
        assert call["attributes"]["server.address"] == "127.0.0.1"
        assert call["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]
