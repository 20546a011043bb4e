"""A task's state, as the task store keeps it on `<app_id>-task-state-changelog`:
its status, keys, last error, the answers of earlier stages, and a short history of
its moves (which record made each one: how a record that runs again knows it already
wrote its outcome).

Stored records are read by every version of the worker during a rolling upgrade:
fields a newer version added are ignored, not a reason to fail (extra="ignore").
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from streams.contract.records import Source, now_iso

HISTORY_LIMIT = 20


class Status(StrEnum):
    RECEIVED = "received"
    PROCESSING = "processing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD_LETTERED = "dead_lettered"


# Stored records are read by every version of the worker during a rolling upgrade:
# fields a newer version added are ignored, not a reason to fail (extra="ignore").


class StoredSource(BaseModel):
    """Where a record came from (`records.Source`), as a task state stores it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    topic: str
    partition: int
    offset: int


class HistoryEntry(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    prompt_version: str | None = None
    result_key: str | None = None
    status: Status
    at: str
    note: str | None = None
    source: StoredSource | None = None  # the record whose run made this move
    # A task forwarded from a source record: that record (`topic/partition/offset`).
    origin: str | None = None
    # A record an operator command sent (a replay, a backtrack): `<its id>@<the record it
    # copied>`, so a copy sent twice (the command killed and run again) ends the task once.
    run: str | None = None


# What a task's history keeps of a run at most (`run_key`): the project's own are ~300
# characters (an id, a topic name of at most 249, a partition and an offset).
RUN_CHARS = 512


def run_key(run_id: bytes, copied: bytes) -> str:
    """`HistoryEntry.run` of a record the command run `run_id` sent as a copy of the
    record `copied` (`topic/partition/offset`): `<run_id>@<copied>`. Longer than
    `RUN_CHARS` (headers another producer wrote): its digest, so that a task's state does
    not carry it into every history entry."""
    said = f"{run_id.decode(errors='replace')}@{copied.decode(errors='replace')}"
    if len(said) > RUN_CHARS:
        return "sha256:" + hashlib.sha256(run_id + b"@" + copied).hexdigest()
    return said


def sent_by_run(run: object, run_id: str) -> bool:
    """Does a history entry's `run` (as `run_key` wrote it) say the run `run_id` sent it?"""
    return isinstance(run, str) and run.startswith(f"{run_id}@")


class TaskState(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

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
    source: StoredSource | None = None
    last_error: dict[str, Any] | None = None
    # Multi-stage pipelines, after a failed stage: the answers of the stages before it
    # (by stage name), for the input hash and version above, and the definition each was
    # made under (`core.stages.definitions`); a re-run starts from there.
    stage_outputs: dict[str, Any] | None = None
    stage_digests: dict[str, str] | None = None
    updated_at: str
    history: list[HistoryEntry] = Field(default_factory=list)

    def dumps(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json", exclude_none=True))

    @classmethod
    def loads(cls, raw: bytes) -> TaskState:
        return cls.model_validate(orjson.loads(raw))

    def dumps_within(self, max_bytes: int) -> bytes:
        """The state as stored, cut to `max_bytes` bytes when it is larger: the stage answers go
        first (a re-run asks those stages again), then the older history, then the last
        error's message."""
        raw = self.dumps()
        if len(raw) <= max_bytes:
            return raw
        state = self.model_copy(update={"stage_outputs": None, "stage_digests": None})
        for cut in (
            {},
            {"history": self.history[-1:]},
            {"history": self.history[-1:], "last_error": _short_error(self.last_error)},
        ):
            raw = state.model_copy(update=cut).dumps()
            if len(raw) <= max_bytes:
                return raw
        return raw  # what is left (ids, keys) is small; the write path refuses the rest

    def moved(
        self,
        status: Status,
        note: str | None = None,
        origin: str | None = None,
        run: str | None = None,
        **changes: Any,
    ) -> TaskState:
        """This state moved to `status`, with the move appended to its history (`origin`:
        the source record the moving record was forwarded from; `run`: the command run
        that sent it, `HistoryEntry.run`)."""
        at = now_iso()
        source = changes.get("source")
        if isinstance(source, Source):
            changes["source"] = source = StoredSource(**source.model_dump())
        entry = HistoryEntry(
            prompt_version=changes.get("prompt_version", self.prompt_version),
            result_key=changes.get("result_key", self.result_key),
            status=status,
            at=at,
            note=note,
            source=source,
            origin=origin,
            run=run,
        )
        history = [*self.history, entry][-HISTORY_LIMIT:]
        return self.model_copy(
            update={**changes, "status": status, "updated_at": at, "history": history}
        )

    def wrote(self, source: Source) -> bool:
        """Did the run of the record at `source` write this task's outcome? (Several
        records of one task can each have written one before their offsets committed.)"""
        done = (Status.SUCCEEDED, Status.DEAD_LETTERED)
        where = (source.topic, source.partition, source.offset)
        return any(
            e.status in done
            and e.source is not None
            and (e.source.topic, e.source.partition, e.source.offset) == where
            for e in self.history
        )

    def ran(self, run: str) -> bool:
        """Did a copy of the record that the command run `run` sent (`HistoryEntry.run`)
        end this task? A second copy of it is the same task, ended once."""
        done = (Status.SUCCEEDED, Status.DEAD_LETTERED)
        return any(e.run == run and e.status in done for e in self.history)

    def came_from(self, origin: str, result_key: str, version: str) -> bool:
        """Did a record forwarded from the source record `origin` end this task — its
        result under `result_key`, or its dead letter under prompt `version`? (A source
        record forwarded again after a crash is the same task, ended once.)"""
        return any(
            e.origin == origin
            and (
                (e.status is Status.SUCCEEDED and e.result_key == result_key)
                or (e.status is Status.DEAD_LETTERED and e.prompt_version == version)
            )
            for e in self.history
        )


def _short_error(error: dict[str, Any] | None) -> dict[str, Any] | None:
    if not error:
        return error
    return {**error, "message": str(error.get("message", ""))[:500]}


__all__ = ["HISTORY_LIMIT", "HistoryEntry", "Status", "StoredSource", "TaskState"]
