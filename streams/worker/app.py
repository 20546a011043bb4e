"""The Faust application: `create_app(settings)`; `app` is built on first access."""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import faust
import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from streams.assembly import processor_factory
from streams.core.budget import Budgets
from streams.core.drift import DriftMonitor
from streams.kafka.limits import WriteLimits
from streams.kafka.scan import Follower
from streams.kafka.security import faust_credentials
from streams.kafka.topics import budget_spend_topic, budgets_topic, drift_baselines_topic
from streams.observability.metrics import Metrics
from streams.observability.page import render_html
from streams.observability.status import SAMPLE_EVERY_S, StatusView
from streams.pipelines.registry import PipelineRegistry
from streams.resilience.limiter import GroupShare
from streams.settings import Settings, load_settings
from streams.store.baselines import refresh_baselines
from streams.store.budgets import BudgetSync
from streams.worker import faust_private
from streams.worker.agent import TaskAgent

log = logging.getLogger(__name__)


class ThreadedApp(faust_private.BoundedWaitEmpty, faust.App):
    """Faust's app, its consumer on Faust's thread, its drain the worker's
    (`faust_private.Consumer`) and its rebalances' wait for records bounded."""

    def _new_transport(self) -> Any:
        return faust_private.Transport(self.conf.broker_consumer, self)


class InLoopApp(ThreadedApp):
    """Faust's app with its consumer on the app's own loop (`faust_private.InLoopConsumer`)."""

    def _new_transport(self) -> Any:
        return faust_private.InLoopTransport(self.conf.broker_consumer, self)


def _at_start_and_every(
    app: faust.App, name: str, seconds: float, read: Callable[[], Awaitable[None]]
) -> None:
    async def run() -> None:
        await read()

    run.__name__ = run.__qualname__ = name  # Faust's name of the task and the timer
    app.task(run)  # faust leaves both decorators untyped
    app.timer(seconds)(run)


# How long a write waits for company before it goes (Kafka's linger.ms). Writes made while
# one is in flight to a broker go together behind it anyway (aiokafka sends one request per
# broker at a time), so a short linger batches behind the calls rather than in front of
# them. bench/latency.py, same hour: 5 ms added 17.3 ms a task at p50 (10 tasks/s) against
# 11.5 at 1 ms and 11.0 at none; at saturation 1 and 5 ms cost alike (1.44-1.67 and 1.48-1.77
# ms a task), none 9% more (1.63-1.97, more and smaller requests).
PRODUCER_LINGER_S = 0.001


def _faust_app(settings: Settings) -> ThreadedApp:
    """The Faust app of `settings`: its broker, its consumer's pace and buffers, no tables."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)  # Faust makes only the last level
    faust_private.commit_table_when_logged()
    buffer = max(settings.batch.buffer, settings.batch.size)
    app = (ThreadedApp if settings.kafka.consumer_thread else InLoopApp)(
        settings.app_id,
        broker=settings.kafka.broker_url,
        broker_credentials=faust_credentials(settings),  # the clients' own security
        store="memory://",  # no Faust tables: the task store (streams.store) keeps the state
        # Exactly-once is the worker's own (streams.worker.eos): Faust runs at-least-once and
        # its offset commits go into the worker's transactions.
        processing_guarantee="at_least_once",
        # Faust's assignor places standbys over the task partitions and gives a partition
        # whose owner left to a worker standing by for it; the task store follows them
        # (store_standby_replicas). At least 1: with 0, Faust's consumer takes aiokafka's
        # round-robin assignor instead, which can give tasks-p and replay-p, one store
        # partition, to two workers. The worker ignores the standbys it did not ask for.
        table_standby_replicas=max(1, settings.store_standby_replicas),
        topic_partitions=settings.kafka.partitions,
        topic_replication_factor=settings.kafka.replication_factor,
        topic_disable_leader=True,
        broker_session_timeout=settings.kafka.session_timeout_s,
        broker_heartbeat_interval=max(0.5, settings.kafka.session_timeout_s / 5),
        broker_commit_interval=settings.kafka.commit_interval_s,
        # Every task ends well before Faust would call the stream stuck.
        stream_processing_timeout=settings.llm.task_deadline_s + 60,
        broker_max_poll_interval=max(300.0, settings.llm.task_deadline_s + 120),
        # Backpressure: Faust pauses a partition once its stream's buffer is 80% full
        # (mode's FlowControlQueue), so fetched-but-unprocessed records stay under about
        # `buffer` however slow the LLM is. The buffer must never fill up: then Faust's
        # conductor waits on it and delivers nothing else, and live records would queue
        # behind a full replay lane. Each poll after the 80% mark pauses at least one more
        # partition, so polls of 20% / partitions records always fit.
        stream_buffer_maxsize=buffer,
        broker_max_poll_records=max(1, buffer // (5 * settings.kafka.partitions)),
        producer_linger=PRODUCER_LINGER_S,
        producer_max_request_size=settings.kafka.max_request_bytes,
        consumer_auto_offset_reset="earliest",
        datadir=str(settings.data_dir),
        web_port=settings.web_port,
        web_bind=settings.web_bind,
        autodiscover=False,
    )
    return app


def _pages(app: faust.App, metrics: Metrics, agent: TaskAgent, settings: Settings,
           registry: PipelineRegistry) -> None:  # fmt: skip
    """The worker's web pages: metrics, its status (JSON and the dashboard), its probes."""

    @app.page("/metrics")
    async def metrics_page(web: Any, request: Any) -> Any:
        # aiohttp refuses a charset inside content_type=, so the header is set whole.
        return web.bytes(metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    host = socket.gethostname()
    pipelines = sorted(registry.pipelines)

    def identity() -> dict[str, Any]:  # what the page's header says the worker is
        return {"host": host, "app_id": settings.app_id, "model": settings.llm.model,
                "endpoint": settings.llm.base_url or "https://api.openai.com/v1 (default)",
                "pipelines": pipelines, "partitions": list(agent.readiness().partitions),
                "guarantee": settings.processing_guarantee}  # fmt: skip

    status = StatusView(metrics, identity=identity)

    async def sample_status() -> None:
        status.sample()

    # The page's charts: a history point every SAMPLE_EVERY_S.
    app.timer(SAMPLE_EVERY_S)(sample_status)

    @app.page("/status.json")
    async def status_json(web: Any, request: Any) -> Any:
        return web.bytes(orjson.dumps(status.snapshot()),
                         headers={"Content-Type": "application/json"})  # fmt: skip

    @app.page("/status")
    async def status_page(web: Any, request: Any) -> Any:
        return web.html(render_html(status.snapshot()))

    @app.page("/healthz")
    async def alive(web: Any, request: Any) -> Any:  # the loop answers (observability.health)
        return web.json({"alive": True, "uptime_s": round(status.uptime_s(), 1)})

    @app.page("/readyz")
    async def ready(web: Any, request: Any) -> Any:
        readiness = agent.readiness()
        return web.json(readiness.as_json(), status=200 if readiness.ready else 503)


def create_app(
    settings: Settings,
    limits: WriteLimits | None = None,
    banner: list[str] | None = None,
    registry: PipelineRegistry | None = None,
) -> faust.App:
    """The worker's Faust app. `limits`: what each written topic takes (read from the
    broker at start by `run_worker`; without them, the producer's limit and Kafka's
    default topic limit). `registry`: the pipelines as `run_worker` loaded them once
    (without it, loaded here)."""
    if registry is None:
        registry = PipelineRegistry.load(settings.pipelines_dir, settings.schemas_dir)
    # The same processor as the Python API's (streams.api): the two cannot drift.
    values = (limits or WriteLimits(settings.kafka.max_request_bytes)).value_limits(settings)
    app = _faust_app(settings)
    app.wait_empty_s = settings.shutdown_grace_s  # no record holds a rebalance longer
    app.llm_streams_settings = settings  # type: ignore[attr-defined]  # for CLI helpers
    metrics = Metrics()
    app.llm_streams_metrics = metrics  # type: ignore[attr-defined]
    group = GroupShare()
    schemas = {name: p.output_schema for name, p in registry.pipelines.items()}
    drift = DriftMonitor(schemas, settings.drift.window)
    metrics.watch_drift(drift.rows)
    budgets = Budgets(group=group, metrics=metrics, saved=True)
    agent = TaskAgent(
        app, settings, processor_factory(settings, registry, metrics, values, group, budgets),
        metrics, limits, sources=registry.sources(), group=group, drift=drift,
    )  # fmt: skip
    app.llm_streams_agent = agent  # type: ignore[attr-defined]  # for the worker's stop

    async def say_what_it_is() -> None:  # once the worker's logging is set up
        for line in banner or ():
            log.info("%s", line)

    app.task(say_what_it_is)
    # At start, then every `refresh_s`: what operators set while the workers run, read by
    # one long-lived reader of those small topics (and the spend saved by one long-lived
    # writer), stopped with the app.
    follower = Follower(settings, [drift_baselines_topic(settings), budgets_topic(settings),
                                   budget_spend_topic(settings)])  # fmt: skip
    _at_start_and_every(app, "read_baselines", settings.drift.refresh_s,
                        lambda: refresh_baselines(settings, drift, follower))  # fmt: skip
    budget_sync = BudgetSync(settings, budgets, follower)
    _at_start_and_every(app, "sync_budgets", settings.budget.refresh_s, budget_sync.sync)

    @app.on_before_shutdown.connect
    async def stop_small_topic_clients(app: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        await follower.stop()
        await budget_sync.stop()

    _pages(app, metrics, agent, settings, registry)
    return app


def __getattr__(name: str) -> Any:
    # `faust -A streams.worker.app` and `python -m streams` need a module-level app; build it
    # only when asked so importing this module reads no environment.
    if name == "app":
        value = create_app(load_settings())
        globals()["app"] = value
        return value
    raise AttributeError(name)
