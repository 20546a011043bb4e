"""Publishing API for producers: validate against the contract, key by task_id (by
session_id for a task of a session: its turns stay in order on one partition), send."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from types import TracebackType
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from pydantic import ValidationError

from streams.contract.headers import ERASE_HEADER
from streams.contract.records import EraseRequest, Task
from streams.errors import InvalidInput
from streams.kafka import clients
from streams.kafka.limits import refused_for_good
from streams.kafka.routing import task_key
from streams.observability.tracing import headers_for
from streams.settings import Settings

log = logging.getLogger(__name__)


class TaskPublisher:
    """Async producer of tasks.

    >>> async with TaskPublisher(settings) as pub:
    ...     await pub.publish({"pipeline": "comment-analysis", "input": {"text": "Great!"}})
    """

    def __init__(self, settings: Settings, *, topic: str | None = None, linger_ms: int = 5) -> None:
        self.settings = settings
        self.topic = topic or settings.topics.tasks
        self._producer = clients.producer(
            settings,
            enable_idempotence=settings.kafka.idempotent_producer,
            acks="all",
            linger_ms=linger_ms,
        )

    async def start(self) -> TaskPublisher:
        await self._producer.start()
        return self

    async def stop(self) -> None:
        await self._producer.stop()

    async def __aenter__(self) -> TaskPublisher:
        return await self.start()

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    @staticmethod
    def build(data: dict[str, Any]) -> Task:
        """A contract-valid Task from a dict; a task_id is generated when absent."""
        if not data.get("task_id"):
            data = {**data, "task_id": str(uuid.uuid4())}
        try:
            return Task.model_validate(data)
        except ValidationError as exc:
            raise InvalidInput(f"not a valid task: {exc.errors(include_url=False)}") from exc

    async def publish(
        self, data: dict[str, Any] | Task, *, wait: bool = True, sends: Sends | None = None,
        name: str = "",
    ) -> Task:  # fmt: skip
        """Validate and send one task (wait=False returns once it is buffered; through
        `sends`, as `name`: its ack or its refusal for good are theirs to wait for)."""
        task = data if isinstance(data, Task) else self.build(data)
        value = orjson.dumps(task.model_dump(mode="json", exclude_none=True))
        # The caller's trace (if a span is current) goes on through the worker.
        key, headers = task_key(task.task_id, task.session_id), headers_for() or None
        if sends is not None:
            await sends.send(name or task.task_id, self.topic, key=key, value=value,
                             headers=headers)  # fmt: skip
            return task
        fut = await self._producer.send(self.topic, key=key, value=value, headers=headers)
        if wait:
            await fut
        return task

    def sends(self) -> Sends:
        """Sends through this publisher's producer, for `publish(sends=...)`."""
        return Sends(self._producer)

    async def erase(
        self,
        task_id: str,
        pipeline: str,
        source_key: Any = None,
        *,
        session_id: str | None = None,
        via: str = "command",
        source_key_base64: str | None = None,
    ) -> None:
        """Ask the workers to erase a task: its results, dead letter, state, review copies
        and sink records (a deletion request: the answers quote its input). Sent to its
        partition of the tasks topic with the `llm-streams-erase` header; the worker that
        owns the partition writes the tombstones. `source_key_base64`: the bytes of a source
        key that is not UTF-8 (a sink keyed by it is erased under them)."""
        request = EraseRequest(task_id=task_id, pipeline=pipeline, source_key=source_key,
                               session_id=session_id,
                               source_key_base64=source_key_base64)  # fmt: skip
        await (await self._producer.send(
            self.topic, key=task_key(task_id, session_id),
            value=request.wire(),
            headers=[(ERASE_HEADER, via.encode())],
        ))  # fmt: skip

    async def publish_raw(self, key: bytes | None, value: bytes | None) -> None:
        """Send bytes as they are (tests and redrives of records that fail the contract)."""
        await (await self._producer.send(self.topic, key=key, value=value))

    async def flush(self) -> None:
        await self._producer.flush()


class Sends:
    """An operator command's records sent through one producer and awaited together. A
    refusal no retry mends (`kafka.limits.refused_for_good`: too large for the producer or
    the topic, invalid, not authorised) is counted and said per record, not raised: one
    record its topic cannot take stopped the rest of a replay, a backtrack or a redrive,
    and again at every run after (a replay resumed from its checkpoint met it first). Any
    other failure is raised. Of the refused, the first `NAMED` are named and logged."""

    NAMED = 10

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self.acked = 0
        self.refused: Counter[str] = Counter()  # why -> records
        self.refused_names: list[str] = []
        self._pending: list[tuple[str, str, asyncio.Future[Any]]] = []

    async def send(self, name: str, topic: str, **record: Any) -> bool:
        """Send one record (`name` says it in a refusal); False: refused at once."""
        try:
            self._pending.append((name, topic, await self.producer.send(topic, **record)))
        except KafkaError as exc:
            if not self._refused(name, topic, exc):
                raise
            return False
        return True

    async def wait(self) -> list[str]:
        """Wait for every record sent so far; the names of those refused meanwhile. A
        failure that is no refusal is raised once every record has its answer (each
        counted: acked or refused), none left unawaited behind it."""
        pending, self._pending = self._pending, []
        if pending:  # asyncio.wait: a cancelled wait leaves the producer's futures alone
            await asyncio.wait([sent for _, _, sent in pending])
        refused, failed = [], None
        for name, topic, sent in pending:
            exc = asyncio.CancelledError() if sent.cancelled() else sent.exception()
            if exc is None:
                self.acked += 1
            elif isinstance(exc, KafkaError) and self._refused(name, topic, exc):
                refused.append(name)
            else:
                failed = failed or exc
        if failed is not None:
            raise failed
        return refused

    def said(self) -> str:
        """The refusals in a line: "" when none."""
        if not self.refused:
            return ""
        whys = ", ".join(f"{n} {why}" for why, n in sorted(self.refused.items()))
        return f"refused for good: {whys} ({', '.join(self.refused_names)})"

    def _refused(self, name: str, topic: str, exc: KafkaError) -> bool:
        why = refused_for_good(exc)
        if why is None:
            return False
        self.refused[why] += 1
        if len(self.refused_names) < self.NAMED:  # a topic refusing every record: said once
            self.refused_names.append(name)
            log.warning("record %s refused for good (%s) by %s: %s", name, why, topic, exc)
        return True
