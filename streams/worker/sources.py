"""Source topics at the edge: records of existing topics (pipelines' `source:`, see
`pipelines.sources`) mapped to tasks and forwarded to their task partition of
`llm-tasks`, keyed by task id, with the record's position in a header
(`llm-streams-source-of`); from there they run as any task. A record that cannot be
mapped, or whose task is too large for `llm-tasks`, becomes an `invalid_input` dead
letter (again if the record runs again after a crash: at-least-once); one that is not
for the pipeline is skipped. Each outcome is counted (`llm_streams_source_records_total`).
Records of sources with `format: registry` (and keys with `key_format: registry`) are
decoded first with the schema registry's schemas (`streams.assembly.SourceReader`): once
per record, whichever pipelines read it; a record that does not decode is a dead letter
of each of them.

The guarantee: the source record is acked once all this is written, so a crash before
its offset commits forwards it again — and its task is answered once all the same. Its
home finds the result of the earlier forward of the same source record in the task's
state (`TaskState.came_from`, the `llm-streams-source-of` header) and writes nothing
more: one result, one sink record. With `exactly_once` the answer, its sink record and
the forwarded record's offset are one transaction of the task partition; the forward
itself and the source offset are written outside every transaction (`plain`: a source
partition is no task partition, and its task's home may be another worker's), which the
home's check makes safe. A source record's own dead letter stays at-least-once.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import orjson
from pydantic import ValidationError

from streams.assembly import SourceReader, uses_registry
from streams.contract.headers import ERASE_HEADER, SOURCE_OF_HEADER, header_items
from streams.contract.records import EraseRequest, Source, describe
from streams.core.processor import TaskProcessor
from streams.errors import ConfigError, InvalidInput, TaskError
from streams.kafka import clients
from streams.kafka.limits import WriteLimits
from streams.kafka.routing import partition_for, partition_of, task_key
from streams.observability.metrics import Metrics
from streams.pipelines.sources import Erase, Skipped, SourceMapper, jsonable, raw_key_text
from streams.schema_registry import RegistryClient, RegistryRefused
from streams.settings import Settings
from streams.worker.writer import Writer

log = logging.getLogger(__name__)


class SourceIngest:
    """Maps and forwards the records of the source topics."""

    def __init__(
        self,
        settings: Settings,
        mappers: dict[str, list[SourceMapper]],
        writer: Writer,
        limits: WriteLimits,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.mappers = mappers
        self.writer = writer
        self.limits = limits
        self.metrics = metrics
        self.reader = SourceReader(settings, metrics)

    @property
    def topics(self) -> list[str]:
        return sorted(self.mappers)

    async def close(self) -> None:
        await self.reader.close()

    async def ingest(self, message: Any, processor: TaskProcessor) -> None:
        """One source record: a task forwarded, a dead letter, or a skip, per pipeline."""
        source = Source(topic=message.topic, partition=message.partition, offset=message.offset)
        where = f"{source.topic}/{source.partition}/{source.offset}"
        items = header_items(message.headers)
        mapped = await self.reader.tasks(self.mappers.get(message.topic, []), message.value,
                                         message.key, items, message.timestamp)  # fmt: skip
        for mapper, task in mapped:
            count = self.metrics.source_records.labels(mapper.pipeline, "forwarded")
            try:
                if isinstance(task, TaskError):
                    raise task
                if isinstance(task, Skipped):
                    self.metrics.source_records.labels(mapper.pipeline, "skipped").inc()
                    continue
                if isinstance(task, Erase):
                    await self._erase(task, mapper.pipeline, where)
                    self.metrics.source_records.labels(mapper.pipeline, "erased").inc()
                    continue
                if isinstance(kept := task.get("source_record"), dict):  # for the sink
                    kept.update(topic=source.topic, partition=source.partition,
                                offset=source.offset)  # fmt: skip
                value = orjson.dumps(task)
                self._fits(value, "the mapped task")
                # Keyed as the publisher keys it: a session's turns to their session's
                # partition, in their source's order (by the task id, each went to its own
                # and was forwarded again from there, in whichever order they came).
                session = mapper.session.session_of(task) if mapper.session else None
                key = task_key(str(task["task_id"]), session)
                await self.writer.forward(
                    self.settings.topics.tasks, key, value,
                    partition_of(key, self.settings.kafka.partitions),
                    [(SOURCE_OF_HEADER, where.encode())], what=f"the task mapped from {where}",
                    plain=True,
                )  # fmt: skip
            except TaskError as exc:
                await self._dead_letter(exc, message, source, processor, mapper.pipeline)
                self.metrics.source_records.labels(mapper.pipeline, "dead_letter").inc()
                continue
            count.inc()

    def _fits(self, value: bytes, what: str) -> None:
        """InvalidInput when `value` is more than a record of the task topic may take."""
        max_bytes = self.limits.value_bytes(self.settings.topics.tasks)
        if len(value) > max_bytes:
            raise InvalidInput(f"{what} takes {len(value)} bytes, over the {max_bytes} it may",
                               code="source_too_large")  # fmt: skip

    async def _erase(self, erase: Erase, pipeline: str, where: str) -> None:
        """A delete upstream: the request to erase its task, to the task's partition (its
        session's, for a task of a session)."""
        try:
            request = EraseRequest(
                task_id=erase.task_id, pipeline=pipeline, source_key=jsonable(erase.key),
                session_id=erase.session_id, source_key_base64=erase.key_base64,
            )  # fmt: skip
        except ValidationError as exc:
            raise InvalidInput(f"the erasure the record asks for breaks the contract: "
                               f"{describe(exc)}", code="source_erase") from None  # fmt: skip
        home = partition_of(
            task_key(erase.task_id, erase.session_id), self.settings.kafka.partitions
        )
        value = request.wire()
        self._fits(value, "the erasure")

        await self.writer.forward(
            self.settings.topics.tasks, erase.task_id.encode(), value, home,
            [(ERASE_HEADER, b"source"), (SOURCE_OF_HEADER, where.encode())],
            what=f"the erasure asked by {where}", plain=True,
        )  # fmt: skip

    async def _dead_letter(
        self,
        exc: TaskError,
        message: Any,
        source: Source,
        processor: TaskProcessor,
        pipeline: str,
    ) -> None:
        outcome = processor.dead_letter(exc, message.value, message.key, source, pipeline)
        # Where a task of that key would live; a record with no key by its position.
        key = raw_key_text(message.key) if message.key else str(source.offset)
        partition = partition_for(key, self.settings.kafka.partitions)
        log.info("source record %s/%d/%d: %s", source.topic, source.partition, source.offset,
                 exc.message)  # fmt: skip
        await self.writer.deliver(outcome, partition, plain=True)


async def check_sources(settings: Settings, mappers: dict[str, list[SourceMapper]]) -> None:
    """At start: every source topic exists (the worker never creates a user's topic, nor
    lets the broker make an empty one for a misspelt name), the guarantee allows them,
    and sources decoded with a schema registry have one that answers. Raises
    ConfigError naming what is wrong."""
    topics = sorted(mappers)
    if not topics:
        return
    registry = sorted({m.pipeline for ms in mappers.values() for m in ms if uses_registry(m)})
    if registry:
        await check_registry(settings, registry)
    admin = clients.admin(settings)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
    finally:
        await admin.close()
    missing = sorted(set(topics) - existing)
    if missing:
        raise ConfigError(f"source topics {missing} (pipelines' `source.topics`) do not exist")


async def check_registry(settings: Settings, pipelines: list[str]) -> None:
    """The schema registry is set and answers with these credentials."""
    url = settings.schema_registry.url
    if url is None:
        raise ConfigError(f"pipelines {pipelines} read sources with format `registry`: set "
                          "LLM_STREAMS_SCHEMA_REGISTRY__URL")  # fmt: skip
    client = RegistryClient(settings.schema_registry)
    try:
        await client.check()
    except (aiohttp.ClientError, TimeoutError, RegistryRefused) as exc:
        raise ConfigError(f"schema registry {url} (LLM_STREAMS_SCHEMA_REGISTRY__URL) does not "
                          f"answer: {type(exc).__name__}: {exc}") from exc  # fmt: skip
    finally:
        await client.close()


__all__ = ["SourceIngest", "check_registry", "check_sources"]
