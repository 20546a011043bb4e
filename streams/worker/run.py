"""Start a Faust worker for the app built from settings."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

import faust

from streams.errors import ConfigError
from streams.kafka.limits import WriteLimits
from streams.observability.logs import logging_config
from streams.resilience.retry import retry_transient
from streams.settings import Settings
from streams.worker.shutdown import Watchdog

if TYPE_CHECKING:
    from streams.pipelines.registry import PipelineRegistry

log = logging.getLogger(__name__)
T = TypeVar("T")


def run_worker(settings: Settings) -> None:
    from streams.kafka.limits import read_limits
    from streams.kafka.security import preflight
    from streams.kafka.topics import ensure_topics, written_topics
    from streams.pipelines.registry import PipelineRegistry
    from streams.worker.app import create_app
    from streams.worker.sinks import prepare_sinks
    from streams.worker.sources import check_sources

    loop = _new_loop()
    asyncio.set_event_loop(loop)
    registry = PipelineRegistry.load(settings.pipelines_dir, settings.schemas_dir)

    async def checks() -> WriteLimits:
        # Before Faust starts: Kafka is reachable with these credentials (or a clear word
        # why not), the topics exist, co-partitioned with the task store.
        await preflight(settings)
        await ensure_topics(settings, written_topics(settings))
        sinks = await prepare_sinks(settings, registry)
        if settings.processing_guarantee == "exactly_once":
            from streams.worker.eos import check_transactions

            await check_transactions(settings)  # or a clear ConfigError
        limits = await read_limits(settings, [*written_topics(settings), *sinks.partitions])
        await check_sources(settings, registry.sources())
        return replace(limits, partitions=sinks.partitions, framing=sinks.framing)

    limits = loop.run_until_complete(while_kafka_away(checks, settings.kafka.startup_wait_s))
    from streams.worker.preflight import banner, llm_preflight

    seen = loop.run_until_complete(llm_preflight(settings, registry))  # or a ConfigError
    from streams.observability.genai import setup_metrics
    from streams.observability.tracing import setup_tracing

    setup_tracing(settings.tracing)
    setup_metrics(settings.tracing)
    app = create_app(settings, limits, banner=banner(settings, registry, seen), registry=registry)
    hidden = secrets(settings, registry)
    worker = BoundedWorker(
        app, loop=loop, loglevel=settings.log_level,
        logging_config=logging_config(settings.log_level, settings.log_format, hidden),
    )  # fmt: skip
    worker.watchdog = app.llm_streams_agent.watchdog  # type: ignore[attr-defined]  # set by create_app
    # Faust's progress spinner sets the root logger to DEBUG so it can spin on every
    # record; then each debug call in aiokafka, the SDK and Faust builds a LogRecord
    # (~5% of a worker's CPU at high rates). Without it the level is what was asked.
    worker.spinner = None
    worker.execute_from_commandline()


class BoundedWorker(faust.Worker):
    """Faust's worker whose stop on SIGTERM/SIGINT is bounded by the shutdown watchdog
    (`streams.worker.shutdown`): in-flight tasks get `shutdown_grace_s`, then it exits."""

    watchdog: Watchdog

    def _schedule_shutdown(self, signal: signal.Signals) -> None:
        self.watchdog.start(f"signal {signal.name}")
        super()._schedule_shutdown(signal)

    async def on_startup_finished(self) -> None:
        await super().on_startup_finished()
        log.debug("%d objects set aside from the garbage collector's full passes",
                  freeze_started_heap())  # fmt: skip


def freeze_started_heap() -> int:
    """Set what a started worker holds (modules, classes, the app, its clients, the
    pipelines: hundreds of thousands of objects) aside from the cyclic garbage
    collector's full passes, which walked all of it every time: 30-180 ms with the loop
    stopped, every task in flight waiting (bench/latency.py's p99 at 10 tasks/s was
    those pauses). What is garbage now goes first; what is frozen is still freed when
    its last reference goes, only cycles among it would stay. Returns how many were
    set aside."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def while_kafka_away(start: Callable[[], Awaitable[T]], wait_s: float) -> T:
    """`start()` again while Kafka is away (refused, unanswered: a broker restarting, a
    failover — routine on managed Kafka), with backoff and a line per try, for up to
    `wait_s`; what waiting cannot mend (a wrong address, credential or certificate, a
    missing topic) is raised at once. Before, a worker started during a broker outage
    exited at once, and every pod restarted then went into Kubernetes' back-off."""
    from streams.kafka.security import broker_away

    return await retry_transient(
        start, what="Kafka at start (LLM_STREAMS_KAFKA__STARTUP_WAIT_S bounds the wait)",
        transient=broker_away, within_s=wait_s, first_s=1.0, max_s=15.0, sleep=asyncio.sleep,
    )  # fmt: skip


def secrets(settings: Settings, registry: PipelineRegistry | None = None) -> list[str]:
    """Secrets the logs must never show: the LLM key, every fallback endpoint's key (of
    `registry`'s pipelines, else of those in the pipelines folder), the Kafka SASL
    password and client key password, the schema registry's password (set, or in its
    URL)."""
    from streams.kafka.security import secrets as kafka_secrets

    found = kafka_secrets(settings)
    if settings.llm.api_key is not None:
        found.append(settings.llm.api_key.get_secret_value())
    schema_registry = settings.schema_registry
    if schema_registry.password is not None:
        found.append(schema_registry.password.get_secret_value())
    if schema_registry.url and (in_url := urlsplit(schema_registry.url).password):
        found.append(in_url)
    if registry is None:
        from streams.pipelines.registry import PipelineRegistry

        try:
            registry = PipelineRegistry.load(settings.pipelines_dir, settings.schemas_dir)
        except ConfigError:
            return found  # the worker will say what is wrong when it loads them
    for pipeline in registry.pipelines.values():
        for version in pipeline.versions.values():
            for fallback in version.spec.fallbacks:
                key = os.environ.get(fallback.api_key_env) if fallback.api_key_env else None
                if key:
                    found.append(key)
    return found


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (~20% more tasks/s on this path), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
