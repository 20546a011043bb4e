"""How the processor and the source reader are built from settings: one place for the
worker (`streams.worker.app`) and the Python API (`streams.api.Analyzer`), so the two
cannot drift — the same task gives the same result key and the same output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from streams.contract.headers import Headers
from streams.contract.records import ValueLimits
from streams.core.budget import Budgets
from streams.core.processor import ProcessorConfig, TaskProcessor
from streams.errors import ConfigError, InternalError, InvalidInput, TaskError
from streams.llm.deployments import load_deployments
from streams.llm.openai_client import OpenAIClient
from streams.observability.metrics import Metrics
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.sources import Erase, Skipped, SourceMapper, source_document
from streams.pipelines.specs import Caps
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.limiter import GroupShare, RateLimiter
from streams.resilience.pool import ClientPool
from streams.schema_registry import RecordDecoder, RegistryClient
from streams.settings import Settings

log = logging.getLogger(__name__)

# What one mapping makes of a source record.
Mapped = dict[str, Any] | Skipped | Erase | TaskError


def uses_registry(mapper: SourceMapper) -> bool:
    return mapper.spec.format == "registry" or mapper.spec.key_format == "registry"


class SourceReader:
    """Records of source topics to tasks, by the pipelines' `source:` mappings: the
    value (and key) decoded as each source says (JSON, or the schema registry's wire
    format) once per record, whichever pipelines read it. The worker's source ingest
    (`worker.sources`) and `Analyzer.analyze_record` both read records here."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self._decoder: RecordDecoder | None = None

    async def tasks(
        self,
        mappers: list[SourceMapper],
        value: bytes | None,
        key: bytes | None,
        headers: Headers | None = None,
        timestamp: float | None = None,
    ) -> list[tuple[SourceMapper, Mapped]]:
        """Per mapper: the task, why the record is skipped, or why it cannot be mapped
        (`InvalidInput`; a bug of the mapping is an `InternalError`: either way the
        record's dead letter, never the caller's crash)."""
        decoded: dict[str, Any] = {}  # "value" / "key" -> decoded, or the InvalidInput
        out: list[tuple[SourceMapper, Mapped]] = []
        for mapper in mappers:
            try:
                task: dict[str, Any] | Skipped | Erase
                if value is None and mapper.spec.erase is None:
                    task = Skipped("tombstone")
                elif uses_registry(mapper):
                    task = await self._map_decoded(mapper, value, key, headers, timestamp,
                                                   decoded)  # fmt: skip
                else:
                    task = mapper.task(value, key, headers, timestamp)
            except InvalidInput as exc:
                out.append((mapper, exc))
                continue
            except Exception as exc:  # a bug must not stop the agent nor lose the record
                log.exception("unexpected error mapping a record for %s", mapper.pipeline)
                out.append((mapper, InternalError(f"internal error mapping the record: {exc!r}",
                                                  code="internal_error")))  # fmt: skip
                continue
            out.append((mapper, task))
        return out

    async def _map_decoded(
        self,
        mapper: SourceMapper,
        value: bytes | None,
        key: bytes | None,
        headers: Headers | None,
        timestamp: float | None,
        decoded: dict[str, Any],
    ) -> dict[str, Any] | Skipped | Erase:
        spec = mapper.spec
        document: Any = None  # a tombstone (with `erase:`): the key alone says what
        if value is None:
            pass
        elif spec.format == "registry":
            document = await self._decoded(decoded, "value", value)
        else:
            document = source_document(value)
        the_key: Any = key
        if key is not None and spec.key_format == "registry":
            the_key = await self._decoded(decoded, "key", key)
        return mapper.map(document, the_key, headers, timestamp)

    async def _decoded(self, decoded: dict[str, Any], part: str, raw: bytes) -> Any:
        if part not in decoded:
            if self._decoder is None:
                if self.settings.schema_registry.url is None:
                    raise ConfigError("a source has format `registry`: set "
                                      "LLM_STREAMS_SCHEMA_REGISTRY__URL")  # fmt: skip
                client = RegistryClient(self.settings.schema_registry, self.metrics)
                self._decoder = RecordDecoder(client)
            try:
                decoded[part] = await self._decoder.decode(raw)
            except InvalidInput as exc:
                if part == "key":
                    exc = InvalidInput(f"source record's key: {exc.message}", code=exc.code)
                decoded[part] = exc
        found = decoded[part]
        if isinstance(found, InvalidInput):
            raise found
        return found

    async def close(self) -> None:
        if self._decoder is not None:
            await self._decoder.client.close()
            self._decoder = None


def processor_factory(
    settings: Settings,
    registry: PipelineRegistry,
    metrics: Metrics | None = None,
    limits: ValueLimits | None = None,
    group: GroupShare | None = None,
    budgets: Budgets | None = None,
) -> Callable[[], TaskProcessor]:
    """What makes the processor of a worker or an `Analyzer`; call it inside the event
    loop that will use it (the HTTP client binds to it). `limits`: what a result and a
    dead letter may take (the worker reads it from its topics); `group`: the worker's
    part of its consumer group's partitions, which its rate limiters claim; `budgets`: the
    spend caps, when the caller keeps them up to date (the worker: `store.budgets`)."""
    llm = settings.llm
    res = settings.resilience
    deployments = load_deployments(llm.deployments_file) if llm.deployments_file else []
    config = ProcessorConfig.from_settings(settings, limits, deployments)

    primary_key = llm.api_key.get_secret_value() if llm.api_key else None

    def http(url: str | None, key: str | None) -> OpenAIClient:
        # The primary key, when read from a file, is read again when it is refused.
        key_file = llm.api_key_file if (url, key) == (llm.base_url, primary_key) else None
        return OpenAIClient(
            base_url=url, api_key=key, connect_timeout_s=llm.connect_timeout_s,
            read_timeout_s=llm.read_timeout_s, max_connections=settings.batch.concurrency,
            key_file=key_file,
        )  # fmt: skip

    def make() -> TaskProcessor:
        seen = metrics or Metrics()
        caps = budgets or Budgets(group=group, metrics=seen)
        caps.cap_deployments({d.name: Caps(usd_per_hour=d.spec.usd_per_hour,
                                           usd_per_day=d.spec.usd_per_day)
                              for d in deployments})  # fmt: skip
        pool = ClientPool(
            base_url=llm.base_url,
            api_key=primary_key,
            make_http=http,
            # Without a configured limit the first call goes alone and the provider's
            # x-ratelimit headers set the ceiling (or none: unlimited).
            make_limiter=lambda: RateLimiter(
                rpm=llm.rpm, tpm=llm.tpm, burst_s=llm.burst_s, group=group
            ),
            deployments=deployments,
            make_deployed=lambda d: OpenAIClient.of_deployment(
                d,
                connect_timeout_s=llm.connect_timeout_s,
                read_timeout_s=llm.read_timeout_s,
                max_connections=settings.batch.concurrency,
            ),
            make_deployed_limiter=lambda d: RateLimiter(
                rpm=d.spec.rpm, tpm=d.spec.tpm, burst_s=llm.burst_s, group=group
            ),
            make_breaker=lambda name: CircuitBreaker(
                name,
                window_s=res.breaker_window_s,
                min_calls=res.breaker_min_calls,
                failure_rate=res.breaker_failure_rate,
                open_s=res.breaker_open_s,
                probes=res.breaker_probes,
            ),
            metrics=seen,
            slow_call_s=res.breaker_slow_call_s,
            context_window=llm.context_window,
            read_timeout_s=llm.read_timeout_s,
            max_concurrency=settings.batch.concurrency,
            capped=caps.deployment_wait,
        )
        return TaskProcessor(
            registry, pool.primary(llm.model), config, clients=pool.for_model, routes=pool.route,
            metrics=seen, close=pool.close, group=group, budgets=caps,
        )  # fmt: skip

    return make


__all__ = ["SourceReader", "processor_factory", "uses_registry"]
