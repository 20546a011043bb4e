"""The Python API: the worker's processing, from your own code.

    from streams.api import Analyzer

    async with Analyzer() as analyzer:  # the settings of the environment, like the worker
        outcome = await analyzer.analyze({"task_id": "c-1", "pipeline": "comment-analysis",
                                          "input": {"text": "The zip broke after two days."}})
        outcome.kind          # "result" or "dead_letter"
        outcome.key           # the result key the worker would write it under
        outcome.record()      # the result (or dead letter) record, as the worker writes it

An `Analyzer` holds what the worker holds per process: the pipelines, one rate
limiter and breaker per endpoint and model, retries, fallbacks, the deadline,
validation and the metrics. It never raises for a task: bad input and provider
failures come back as dead letters, as in the worker. It writes nothing: what
to do with the outcome (a topic, a table) is the caller's. `examples/faust_app.py`
uses it inside a Faust agent.

The worker builds its processor here (`processor_factory`), so the two cannot
drift: the same task gives the same result key and the same output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from streams.contract.lanes import Lane
from streams.contract.records import RecordRoom, Source
from streams.core.outcome import Outcome
from streams.core.processor import ProcessorConfig, TaskProcessor
from streams.llm.openai_client import OpenAIClient
from streams.observability.metrics import Metrics
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.limiter import RateLimiter
from streams.resilience.pool import ClientPool
from streams.settings import Settings, load_settings

# Where a task given to the API comes from, when the caller does not say.
API_SOURCE = Source(topic="api", partition=0, offset=0)


def processor_factory(
    settings: Settings,
    registry: PipelineRegistry,
    metrics: Metrics | None = None,
    room: RecordRoom | None = None,
) -> Callable[[], TaskProcessor]:
    """What makes the processor of a worker or an `Analyzer`; call it inside the event
    loop that will use it (the HTTP client binds to it). `room`: what a result and a
    dead letter may take (the worker reads it from its topics)."""
    llm = settings.llm
    res = settings.resilience
    config = ProcessorConfig.from_settings(settings, room)

    def make() -> TaskProcessor:
        pool = ClientPool(
            base_url=llm.base_url,
            api_key=llm.api_key.get_secret_value() if llm.api_key else None,
            make_http=lambda url, key: OpenAIClient(
                base_url=url,
                api_key=key,
                connect_timeout_s=llm.connect_timeout_s,
                read_timeout_s=llm.read_timeout_s,
                max_connections=settings.batch.concurrency,
            ),
            # Without a configured limit the first call goes alone and the provider's
            # x-ratelimit headers set the ceiling (or none: unlimited).
            make_limiter=lambda: RateLimiter(rpm=llm.rpm, tpm=llm.tpm, burst_s=llm.burst_s),
            make_breaker=lambda name: CircuitBreaker(
                name,
                window_s=res.breaker_window_s,
                min_calls=res.breaker_min_calls,
                failure_rate=res.breaker_failure_rate,
                open_s=res.breaker_open_s,
                probes=res.breaker_probes,
            ),
            metrics=metrics,
            slow_call_s=res.breaker_slow_call_s,
        )
        return TaskProcessor(
            registry, pool.primary(llm.model), config, clients=pool.for_model,
            metrics=metrics, close=pool.close,
        )  # fmt: skip

    return make


class Analyzer:
    """The worker's processing for tasks you hand it (see the module's docstring)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        registry: PipelineRegistry | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings or load_settings()
        self.registry = registry or PipelineRegistry.load(
            self.settings.pipelines_dir, self.settings.schemas_dir
        )
        self.metrics = metrics or Metrics()
        self._make = processor_factory(self.settings, self.registry, self.metrics)
        self._processor: TaskProcessor | None = None

    @property
    def processor(self) -> TaskProcessor:
        if self._processor is None:  # made in the caller's event loop, on first use
            self._processor = self._make()
        return self._processor

    async def analyze(
        self,
        task: Mapping[str, Any] | bytes,
        *,
        key: bytes | None = None,
        source: Source | None = None,
        lane: Lane = Lane.LIVE,
    ) -> Outcome:
        """One task (a mapping in record contract v1, or a record's raw value) answered:
        its result or its dead letter. `key`: the record's key, if it had one; `source`:
        where it came from (it goes in the result, and into nothing else)."""
        raw = task if isinstance(task, bytes) else orjson.dumps(dict(task))
        return await self.processor.process(raw, key, source or API_SOURCE, lane)

    async def close(self) -> None:
        if self._processor is not None:
            await self._processor.close()
            self._processor = None

    async def __aenter__(self) -> Analyzer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["API_SOURCE", "Analyzer", "processor_factory"]
