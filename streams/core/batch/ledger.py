"""The batch lane's ledger: what a worker must find again after a crash — its batches
(`batch/<local id>`: a `BatchRecord`), where each request went (`item/<custom id>/<attempt>`)
and the records parked on them (`job/<result key>`), on the task store's ledger map — and
the tasks erased (`erased/<task id>`: when): a record of such a task written before its
erasure is not answered (`worker.flow`) — a batch-lane job parked when the erasure came
(it cannot find the job: its key is a result key the task's state does not know yet), a
replay sent before it, a group read again from the start. Entries expire with the
ledger's retention (`retention.ledger_days`, longer than any batch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

# Bytes one request takes in its batch's ledger record (`["rk1-<40 hex>", attempt],`).
LEDGER_ITEM_BYTES = 64
JOB_PREFIX = b"job/"


class Ledger(Protocol):
    """The durable ledger of one worker's partitions (the task store's ledger map on
    `<app_id>-batch-ledger`): what a worker must find again after a crash."""

    def get(self, partition: int, key: bytes) -> bytes | None: ...

    async def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        """Write (None: delete) once the broker has it."""

    async def durable(self, partition: int) -> None:
        """Return once what was put for `partition` can no longer be undone (exactly-once:
        its transaction committed); raise if it never will be (the partition was lost)."""

    def keys(self, partition: int, prefix: bytes) -> list[bytes]: ...

    def owns(self, partition: int) -> bool: ...


def item_key(custom_id: str, attempt: int) -> bytes:
    return f"item/{custom_id}/{attempt}".encode()


def batch_key(local_id: str) -> bytes:
    return f"batch/{local_id}".encode()


def job_key(key: str) -> bytes:
    return JOB_PREFIX + key.encode()


def erased_key(task_id: str) -> bytes:
    return b"erased/" + task_id.encode()


def erasure_mark(at: float) -> bytes:
    """The ledger's word that a task was erased at `at` (seconds since the epoch)."""
    return orjson.dumps({"at": at})


def erased_since(mark: bytes | None, taken_at: float | None) -> bool:
    """Whether a record of a task written at `taken_at` (None: unknown) was erased since,
    by its task's erasure `mark` (None: never erased). A mark this version cannot read, or
    a record's unknown time, counts as erased: the answer is not written back."""
    if mark is None:
        return False
    try:
        at = float(orjson.loads(mark)["at"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return True
    return taken_at is None or taken_at <= at


@dataclass
class BatchRecord:
    """A ledger batch record."""

    local_id: str
    partition: int
    items: list[list[Any]]  # [custom_id, attempt]
    tokens: int
    created_at: float
    state: str = "creating"  # creating | submitted | done
    remote_id: str | None = None
    status: str | None = None  # the provider's final status
    error_code: str | None = None  # why the provider failed it
    output_file_id: str | None = None
    error_file_id: str | None = None
    lines: list[Any] = field(default_factory=list, repr=False)  # in memory only
    released: bool = field(default=False, repr=False)  # its tokens left the enqueued count

    def dumps(self) -> bytes:
        data = {k: v for k, v in self.__dict__.items() if k not in ("lines", "released")}
        return orjson.dumps(data)

    @classmethod
    def loads(cls, raw: bytes) -> BatchRecord:
        data = orjson.loads(raw)
        known = {f for f in cls.__dataclass_fields__ if f not in ("lines", "released")}
        return cls(**{k: v for k, v in data.items() if k in known})  # a newer version's extras


__all__ = ["JOB_PREFIX", "LEDGER_ITEM_BYTES", "BatchRecord", "Ledger", "batch_key", "erased_key",
           "erased_since", "erasure_mark", "item_key", "job_key"]  # fmt: skip
