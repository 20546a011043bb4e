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
validation and the metrics. A task of a session (a version with `session:`) gets
the session's earlier turns in its prompt, as in the worker: the analyzer keeps
them in memory (`SessionTurns`: the least recently used sessions go first beyond
`max_sessions`) and runs one turn of a session at a time, in the order asked. It
never raises for a task: bad input and provider failures come back as dead letters,
as in the worker. It writes nothing: what to do with the outcome (a topic, a table)
is the caller's. `examples/faust_app.py` uses it inside a Faust agent.

The worker builds its processor here (`processor_factory`), so the two cannot
drift: the same task gives the same result key and the same output.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import orjson

from streams.contract.headers import Headers
from streams.contract.lanes import Lane
from streams.contract.records import RecordRoom, Source
from streams.core.outcome import Outcome
from streams.core.processor import ProcessorConfig, TaskProcessor
from streams.errors import ConfigError, InternalError, InvalidInput, TaskError
from streams.llm.openai_client import OpenAIClient
from streams.observability.metrics import Metrics
from streams.pipelines.registry import PipelineRegistry
from streams.pipelines.sources import Skipped, SourceMapper
from streams.resilience.breaker import CircuitBreaker
from streams.resilience.limiter import GroupShare, RateLimiter
from streams.resilience.pool import ClientPool
from streams.schema_registry import RecordDecoder, RegistryClient
from streams.settings import Settings, load_settings

log = logging.getLogger(__name__)

# Where a task given to the API comes from, when the caller does not say.
API_SOURCE = Source(topic="api", partition=0, offset=0)


def uses_registry(mapper: SourceMapper) -> bool:
    return mapper.spec.format == "registry" or mapper.spec.key_format == "registry"


class SourceReader:
    """Records of source topics to tasks, by the pipelines' `source:` mappings: the
    value (and key) decoded as each source says (JSON, or the schema registry's wire
    format) once per record, whichever pipelines read it. The worker's source ingest
    (`kafka.sources`) and `Analyzer.analyze_record` both read records here."""

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
    ) -> list[tuple[SourceMapper, dict[str, Any] | Skipped | TaskError]]:
        """Per mapper: the task, why the record is skipped, or why it cannot be mapped
        (`InvalidInput`; a bug of the mapping is an `InternalError`: either way the
        record's dead letter, never the caller's crash)."""
        decoded: dict[str, Any] = {}  # "value" / "key" -> decoded, or the InvalidInput
        out: list[tuple[SourceMapper, dict[str, Any] | Skipped | TaskError]] = []
        for mapper in mappers:
            try:
                if value is None:
                    task: dict[str, Any] | Skipped = Skipped("tombstone")
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
        value: bytes,
        key: bytes | None,
        headers: Headers | None,
        timestamp: float | None,
        decoded: dict[str, Any],
    ) -> dict[str, Any] | Skipped:
        spec = mapper.spec
        if spec.format == "registry":
            document = await self._decoded(decoded, "value", value)
        else:
            try:
                document = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise InvalidInput(f"source record is not JSON: {exc}",
                                   code="source_not_json") from exc  # fmt: skip
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
    room: RecordRoom | None = None,
    group: GroupShare | None = None,
) -> Callable[[], TaskProcessor]:
    """What makes the processor of a worker or an `Analyzer`; call it inside the event
    loop that will use it (the HTTP client binds to it). `room`: what a result and a
    dead letter may take (the worker reads it from its topics); `group`: the worker's
    part of its consumer group's partitions, which its rate limiters claim."""
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
            make_limiter=lambda: RateLimiter(
                rpm=llm.rpm, tpm=llm.tpm, burst_s=llm.burst_s, group=group
            ),
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
            context_window=llm.context_window,
            read_timeout_s=llm.read_timeout_s,
            max_concurrency=settings.batch.concurrency,
        )
        return TaskProcessor(
            registry, pool.primary(llm.model), config, clients=pool.for_model,
            metrics=metrics, close=pool.close,
        )  # fmt: skip

    return make


class SessionTurns:
    """The turns of an `Analyzer`'s sessions, in memory: what the worker keeps in its
    task store's sessions map. At most `max_sessions` sessions and `max_bytes` of turns
    (a session's turns are bounded by its version's `max_turns` alone), the least
    recently used dropped first (a dropped session's next turn starts without history).
    Subclass it (`get`, `put`) to keep them elsewhere."""

    def __init__(self, max_sessions: int = 10_000, max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_sessions < 1 or max_bytes < 1:
            raise ValueError("max_sessions and max_bytes must be at least 1")
        self.max_sessions, self.max_bytes = max_sessions, max_bytes
        self._turns: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        # One turn of a session at a time: a lock per session while a turn holds or
        # awaits it, dropped with the last (so locks never outnumber turns in flight).
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def get(self, session: str) -> bytes | None:
        found = self._turns.get(session)
        if found is not None:
            self._turns.move_to_end(session)
        return found

    def put(self, session: str, turns: bytes) -> None:
        self._bytes += len(turns) - len(self._turns.get(session, b""))
        self._turns[session] = turns
        self._turns.move_to_end(session)
        while len(self._turns) > self.max_sessions or self._bytes > self.max_bytes:
            self._bytes -= len(self._turns.popitem(last=False)[1])

    @asynccontextmanager
    async def turn(self, session: str) -> AsyncIterator[None]:
        """Held while one turn of `session` runs."""
        lock, users = self._locks.get(session, (asyncio.Lock(), 0))
        self._locks[session] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[session]
            if users == 1:
                del self._locks[session]
            else:
                self._locks[session] = (lock, users - 1)


class Analyzer:
    """The worker's processing for tasks you hand it (see the module's docstring)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        registry: PipelineRegistry | None = None,
        metrics: Metrics | None = None,
        sessions: SessionTurns | None = None,
    ) -> None:
        self.settings = settings or load_settings()
        self.registry = registry or PipelineRegistry.load(
            self.settings.pipelines_dir, self.settings.schemas_dir
        )
        self.metrics = metrics or Metrics()
        self._make = processor_factory(self.settings, self.registry, self.metrics)
        self.reader = SourceReader(self.settings, self.metrics)
        self.sessions = sessions or SessionTurns()
        self._positions = itertools.count(1)  # a session's turns, in the order asked
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
        return await self._answer(raw, key, source or API_SOURCE, lane)

    async def _answer(self, raw: bytes, key: bytes | None, source: Source, lane: Lane) -> Outcome:
        processor = self.processor
        session = processor.session_hint(raw)
        if session is None:
            return await processor.process(raw, key, source, lane)
        async with self.sessions.turn(session):
            prep = processor.prepare(raw, key, source, history=self.sessions.get,
                                     position=next(self._positions))  # fmt: skip
            if isinstance(prep, Outcome):
                return prep
            outcome = await processor.answer(prep, lane)
            if outcome.output is not None and prep.session is not None:
                turns = prep.session_turns(self.sessions.get(prep.session), outcome.output)
                if turns is not None:
                    self.sessions.put(prep.session, turns)
            return outcome

    async def analyze_record(
        self,
        pipeline: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Headers | None = None,
        timestamp: float | None = None,
        source: Source | None = None,
        lane: Lane = Lane.LIVE,
    ) -> Outcome | Skipped:
        """A record of one of `pipeline`'s source topics (its `source:` mapping, decoded
        with the schema registry if the source says so) answered; or why it is skipped
        (its filter, a tombstone). A record that cannot be mapped is a dead letter."""
        mapper = self.registry.get(pipeline).source
        if mapper is None:
            raise ConfigError(f"pipeline {pipeline} declares no `source:` mapping")
        source = source or API_SOURCE
        [(_, task)] = await self.reader.tasks([mapper], value, key, headers, timestamp)
        if isinstance(task, TaskError):
            return self.processor.dead_letter(task, value, key, source)
        if isinstance(task, Skipped):
            return task
        task_key = str(task["task_id"]).encode()
        return await self._answer(orjson.dumps(task), task_key, source, lane)

    async def close(self) -> None:
        await self.reader.close()
        if self._processor is not None:
            await self._processor.close()
            self._processor = None

    async def __aenter__(self) -> Analyzer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = [
    "API_SOURCE", "Analyzer", "SessionTurns", "SourceReader", "processor_factory",
    "uses_registry",
]  # fmt: skip
