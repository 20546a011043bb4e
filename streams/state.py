"""Task state in Faust tables, and the answers the worker already has.

Three tables, co-partitioned with the task topics (a task's entries live in
the partition its record came from):

* results: result_key -> result record. Its changelog IS the results topic,
  so writing a result and recording it are one write, and after a restart the
  table is rebuilt from the results topic itself.
* dead letters: dead-letter key -> dead-letter record; changelog = the
  dead-letter topic.
* task state: task_id -> `TaskState` (status, keys, last error, history);
  changelog `<app_id>-task-state-changelog`.

Under `exactly_once` Faust writes every changelog record in the transaction of
the source partition together with its consumer offsets, so a result, its
state and the offset commit or vanish together. Under `at_least_once` the
offsets commit only after the producer flushed them.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any

import faust
import orjson
from faust.streams import _current_event
from faust.types import FutureMessage
from pydantic import BaseModel, ConfigDict, Field

from streams.records import Source, now_iso

HISTORY_LIMIT = 20


def make_current(event: Any) -> None:
    """Make `event` the current one in this task's context.

    Faust routes table writes to the partition of the current event, which it
    sets only while the agent iterates; jobs running concurrently set their own.
    (Private Faust API, kept to this one place.)
    """
    _current_event.set(weakref.ref(event))


class Status(StrEnum):
    RECEIVED = "received"
    PROCESSING = "processing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD_LETTERED = "dead_lettered"


class HistoryEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_version: str | None = None
    result_key: str | None = None
    status: Status
    at: str
    note: str | None = None


class TaskState(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str
    status: Status
    stage: str = "main"
    attempts: int = 0
    input_hash: str | None = None
    pipeline: str | None = None
    prompt_version: str | None = None
    result_key: str | None = None
    result_topic: str | None = None
    result_partition: int | None = None
    source: Source | None = None
    last_error: dict[str, Any] | None = None
    updated_at: str
    history: list[HistoryEntry] = Field(default_factory=list)

    def dumps(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json", exclude_none=True))

    @classmethod
    def loads(cls, raw: bytes) -> TaskState:
        return cls.model_validate(orjson.loads(raw))

    def moved(self, status: Status, note: str | None = None, **changes: Any) -> TaskState:
        """This state moved to `status`, with the move appended to its history."""
        at = now_iso()
        entry = HistoryEntry(
            prompt_version=changes.get("prompt_version", self.prompt_version),
            result_key=changes.get("result_key", self.result_key),
            status=status,
            at=at,
            note=note,
        )
        history = [*self.history, entry][-HISTORY_LIMIT:]
        return self.model_copy(
            update={**changes, "status": status, "updated_at": at, "history": history}
        )


class DurableTable(faust.Table[bytes, bytes]):
    """A table whose `put` hands back the changelog write, so the caller can wait for
    the broker's ack before it acks the input record (Faust's own `__setitem__` drops it).
    """

    _last_send: FutureMessage | None = None

    def on_key_set(self, key: Any, value: Any) -> None:
        # Faust's Table.on_key_set, keeping the future it throws away.
        fut = self.send_changelog(self.partition_for_key(key), key, value)
        partition = fut.message.partition
        assert partition is not None  # eager partitioning fixes it at send time
        self._maybe_set_key_ttl(key, partition)
        self._sensor_on_set(self, key, value)
        self._last_send = fut

    def put(self, key: bytes, value: bytes) -> FutureMessage:
        self[key] = value
        fut = self._last_send
        assert fut is not None
        self._last_send = None
        return fut


class StateTables:
    """The worker's tables; build before the app starts (Faust registers them)."""

    def __init__(
        self,
        app: faust.App,
        *,
        results_topic: faust.TopicT,
        dead_letter_topic: faust.TopicT,
        state_topic: faust.TopicT,
        partitions: int,
    ) -> None:
        def table(name: str, changelog: faust.TopicT) -> DurableTable:
            made = DurableTable(
                app, name=name, beacon=app.tables.beacon, partitions=partitions,
                changelog_topic=changelog, key_type=bytes, value_type=bytes,
            )  # fmt: skip
            app.tables.add(made)
            return made

        self.results = table("llm-streams-results", results_topic)
        self.dead_letters = table("llm-streams-dead-letters", dead_letter_topic)
        self.tasks = table("llm-streams-task-state", state_topic)

    def state(self, task_id: str) -> TaskState | None:
        raw = self.tasks.get(task_id.encode())
        return TaskState.loads(raw) if raw is not None else None

    def put_state(self, state: TaskState) -> FutureMessage:
        return self.tasks.put(state.task_id.encode(), state.dumps())


class ContentCache:
    """Answers by content key, shared by identical inputs (any task id) in this worker.

    Bounded LRU of outputs, plus single flight: while one task's call for a
    content key runs, identical tasks wait for it instead of calling again.
    """

    def __init__(self, max_entries: int = 50_000) -> None:
        self.max_entries = max_entries
        self._done: OrderedDict[str, tuple[dict[str, Any], str]] = OrderedDict()
        self._running: dict[str, asyncio.Future[tuple[dict[str, Any], str] | None]] = {}

    def get(self, key: str) -> tuple[dict[str, Any], str] | None:
        hit = self._done.get(key)
        if hit is not None:
            self._done.move_to_end(key)
        return hit

    def put(self, key: str, output: dict[str, Any], model: str) -> None:
        self._done[key] = (output, model)
        self._done.move_to_end(key)
        while len(self._done) > self.max_entries:
            self._done.popitem(last=False)

    async def shared(
        self, key: str, call: Callable[[], Awaitable[tuple[Any, tuple[dict[str, Any], str] | None]]]
    ) -> tuple[Any, bool]:
        """`call()` once per key at a time. Returns (what call returned, False) for the
        caller that made the call, or (the cached answer, True) for those that waited.
        When the call gives no answer (a dead letter), a waiter makes its own call."""
        while True:
            hit = self.get(key)
            if hit is not None:
                return hit, True
            running = self._running.get(key)
            if running is None:
                break
            waited = await asyncio.shield(running)
            if waited is not None:
                return waited, True
        future: asyncio.Future[tuple[dict[str, Any], str] | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._running[key] = future
        answer: tuple[dict[str, Any], str] | None = None
        try:
            value, answer = await call()
            if answer is not None:
                self.put(key, *answer)
            return value, False
        finally:
            del self._running[key]
            future.set_result(answer)


__all__ = [
    "ContentCache",
    "DurableTable",
    "HistoryEntry",
    "StateTables",
    "Status",
    "TaskState",
    "make_current",
]
