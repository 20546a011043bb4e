"""The GenAI client metrics of the semantic conventions, recorded per attempt with the
request model and the pipeline version."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from streams.contract.records import Source
from streams.errors import UpstreamError
from streams.observability.genai import GenAIMetrics, endpoint_attributes
from tests.conftest import MakeProcessor
from tests.fakes import FakeLLM, answer

GOOD = {"sentiment": "positive", "confidence": 0.9, "topics": ["quality"], "issues": [],
        "summary": "good", "language": "en"}  # fmt: skip


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    found: dict[str, list[Any]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


async def test_each_attempt_records_its_tokens_and_duration(
    make_processor: MakeProcessor,
) -> None:
    reader = InMemoryMetricReader()
    genai = GenAIMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
    replies = iter(
        [
            UpstreamError("boom", code="http_500"),
            answer(GOOD, prompt_tokens=120, completion_tokens=30, model="sim-1-0613"),
        ]
    )

    def behave(_request: Any) -> Any:
        reply = next(replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    processor = make_processor(FakeLLM(behave))
    processor.calls.genai = genai
    task = {"task_id": "t1", "pipeline": "comment-analysis", "prompt_version": "v1",
            "input": {"text": "Great phone."}}  # fmt: skip
    out = await processor.process(orjson.dumps(task), b"t1", Source(topic="t", partition=0,
                                                                     offset=1))  # fmt: skip
    assert out.kind == "result" and out.attempts == 2
    found = points(reader)
    durations = found["gen_ai.client.operation.duration"]
    assert sorted(p.count for p in durations) == [1, 1]
    failed = next(p for p in durations if "error.type" in p.attributes)
    assert failed.attributes["error.type"] == "upstream_error"
    ok = next(p for p in durations if "error.type" not in p.attributes)
    assert ok.attributes["gen_ai.response.model"] == "sim-1-0613"
    for p in durations:
        assert p.attributes["gen_ai.operation.name"] == "chat"
        assert p.attributes["gen_ai.provider.name"] == "openai"  # an OpenAI-compatible fake
        assert "gen_ai.system" not in p.attributes  # deprecated by the conventions
        assert p.attributes["gen_ai.request.model"] == "sim-1"
        assert p.attributes["llm_streams.pipeline"] == "comment-analysis"
        assert p.attributes["llm_streams.prompt_version"] == "v1"
    tokens = {p.attributes["gen_ai.token.type"]: p.sum
              for p in found["gen_ai.client.token.usage"]}  # fmt: skip
    assert tokens == {"input": 120, "output": 30}


@pytest.mark.parametrize(
    ("endpoint", "server", "expected"),
    [
        ("https://api.openai.com/v1", None,
         {"gen_ai.provider.name": "openai", "server.address": "api.openai.com", "server.port": 443}),
        ("https://shop-eu.openai.azure.com/openai", None,
         {"gen_ai.provider.name": "azure.ai.openai", "server.address": "shop-eu.openai.azure.com",
          "server.port": 443}),
        ("http://127.0.0.1:8080/v1/", "llama.cpp",
         {"gen_ai.provider.name": "llama.cpp", "server.address": "127.0.0.1", "server.port": 8080}),
        ("http://vllm.internal:8000/v1", None,  # said nothing of itself: the API it speaks
         {"gen_ai.provider.name": "openai", "server.address": "vllm.internal", "server.port": 8000}),
    ],
)  # fmt: skip
def test_an_endpoint_is_named_as_the_conventions_say(
    endpoint: str, server: str | None, expected: dict[str, Any]
) -> None:
    assert endpoint_attributes(endpoint, server) == expected


def test_an_endpoints_attributes_are_worked_out_once_and_cannot_be_changed_by_a_caller() -> None:
    first = endpoint_attributes("http://127.0.0.1:8080/v1/", "llama.cpp")
    assert endpoint_attributes("http://127.0.0.1:8080/v1/", "llama.cpp") is first
    with pytest.raises(TypeError):  # shared by every attempt: a caller's change would leak
        first["server.port"] = 1  # type: ignore[index]
    assert endpoint_attributes("http://127.0.0.1:8080/v1/", None) is not first  # per server
    assert first["server.port"] == 8080
