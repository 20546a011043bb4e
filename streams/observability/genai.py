"""OpenTelemetry GenAI client metrics, as the semantic conventions name them:
`gen_ai.client.token.usage` (tokens per attempt, by `gen_ai.token.type` input|output)
and `gen_ai.client.operation.duration` (seconds per attempt, with `error.type` when it
failed), with the request and response model and, beyond the conventions, the
pipeline and prompt version (`llm_streams.pipeline`, `llm_streams.prompt_version`).

The adapter posts chat completions itself (streams/llm/openai_client.py), so the
official OpenAI instrumentation never sees the calls: they are recorded here, next
to the attempt spans (`core.calls`). The duration of an answered attempt is the
call's own (the guarded client's, the limiter's wait excluded); a failed attempt's
is measured from its start, a wait for the limiter included. They go out with the OTLP exporter when
tracing exports to OTLP (`setup_metrics`); otherwise the API's no-op meter takes them.
The Prometheus view of the same per version is `llm_streams_version_*` (metrics.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from urllib.parse import urlsplit

from opentelemetry import metrics
from opentelemetry.metrics import Meter

from streams.settings import TracingSettings

# The conventions' advised bucket boundaries.
TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                 16777216, 67108864]  # fmt: skip
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92]  # fmt: skip
EXPORT_INTERVAL_MS = 15_000

# Hosts whose provider has a name of its own in the conventions (`gen_ai.provider.name`).
_PROVIDER_HOSTS = (
    ("openai.azure.com", "azure.ai.openai"), ("api.openai.com", "openai"),
    ("api.anthropic.com", "anthropic"), ("api.mistral.ai", "mistral_ai"),
    ("api.groq.com", "groq"), ("api.deepseek.com", "deepseek"), ("api.x.ai", "x_ai"),
    ("generativelanguage.googleapis.com", "gcp.gemini"), ("api.perplexity.ai", "perplexity"),
)  # fmt: skip


@functools.lru_cache(maxsize=256)  # a worker's endpoints and the servers they said they are
def endpoint_attributes(endpoint: str, server: str | None = None) -> Mapping[str, str | int]:
    """The conventions' attributes of an endpoint: `gen_ai.provider.name` (the known
    provider of its host, else the server it said it is — llama.cpp, vllm, ollama —, else
    "openai", the API it speaks), `server.address` and `server.port`. Kept per endpoint
    and server, read-only: every attempt of every task asks (a URL parsed and nine hosts
    compared, each time, before)."""
    parts = urlsplit(endpoint if "//" in endpoint else f"//{endpoint}")
    host = parts.hostname or ""
    provider = next((name for suffix, name in _PROVIDER_HOSTS if host.endswith(suffix)),
                    server or "openai")  # fmt: skip
    found: dict[str, str | int] = {"gen_ai.provider.name": provider, "server.address": host}
    try:
        port = parts.port
    except ValueError:
        port = None
    if port or parts.scheme:
        found["server.port"] = port or (443 if parts.scheme == "https" else 80)
    return MappingProxyType(found)


class GenAIMetrics:
    """The two GenAI client histograms, on `meter` (default: the process's)."""

    def __init__(self, meter: Meter | None = None) -> None:
        meter = meter or metrics.get_meter("llm-streams")
        self.tokens = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}",
            description="Measures number of input and output tokens used",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )  # fmt: skip
        self.duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s",
            description="GenAI operation duration",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )  # fmt: skip

    def attempt(
        self,
        *,
        request_model: str,
        seconds: float,
        pipeline: str,
        version: str,
        response_model: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        error_type: str | None = None,
        endpoint: Mapping[str, str | int] | None = None,
    ) -> None:
        """One chat attempt: its duration, and its tokens when it was answered; `endpoint`:
        its `endpoint_attributes`."""
        attrs: dict[str, str | int] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            **(endpoint or {}),
            "gen_ai.request.model": request_model,
            "llm_streams.pipeline": pipeline,
            "llm_streams.prompt_version": version,
        }
        if response_model:
            attrs["gen_ai.response.model"] = response_model
        if error_type:
            attrs["error.type"] = error_type
        self.duration.record(seconds, {**attrs})
        if input_tokens is not None:
            self.tokens.record(input_tokens, {**attrs, "gen_ai.token.type": "input"})
        if output_tokens is not None:
            self.tokens.record(output_tokens, {**attrs, "gen_ai.token.type": "output"})


def setup_metrics(settings: TracingSettings) -> None:
    """A meter provider exporting to OTLP when tracing does (same endpoint variables)."""
    if settings.exporter != "otlp":
        return
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(), export_interval_millis=EXPORT_INTERVAL_MS
    )
    resource = Resource.create({"service.name": settings.service_name})
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[reader]))


GENAI = GenAIMetrics()

__all__ = ["GENAI", "GenAIMetrics", "setup_metrics"]
