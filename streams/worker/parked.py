"""Records parked in the batch lane's ledger (see `core.batch`): how the ledger keeps
one (`StoredRecord`), and how the owner of its partition runs it again (`Resumer`).

A parked record is run again when the batch lane says its batch ended, and every
record parked in a partition when the partition is new to this worker (which
follows every batch in flight there). Runs go through the replay lane's share of
the concurrency slots, one at a time per record; once one ends with an outcome
written, its `job/` entry is deleted. A partition this worker lost is left to its
new owner.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from streams.contract.headers import Headers, header_items
from streams.contract.lanes import Lane
from streams.core.batch import BatchLane, job_key
from streams.core.decide import Ended
from streams.core.dispatch import Dispatcher, LaneSlots
from streams.store.taskstore import Kind, TaskStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredRecord:
    """An input record as the batch lane's ledger keeps it while its job is parked: what
    the agent reads of a Faust message, to run it again."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: Headers
    timestamp: float | None

    @classmethod
    def of(cls, message: Any) -> StoredRecord:
        return cls(message.topic, message.partition, message.offset, message.key,
                   message.value or b"", header_items(message.headers),
                   message.timestamp)  # fmt: skip

    def pack(self) -> bytes:
        """A JSON object (the ledger's readers take only those); bytes in base64."""
        return orjson.dumps({
            "topic": self.topic, "partition": self.partition, "offset": self.offset,
            "key": _b64(self.key), "value": _b64(self.value),
            "headers": [[k, _b64(v)] for k, v in self.headers],
            "timestamp": self.timestamp,
        })  # fmt: skip

    @classmethod
    def unpack(cls, raw: bytes) -> StoredRecord:
        """The record `pack` kept: its position and value needed, the rest as said (a
        version that wrote more, or less, of it is read alike). Raises ValueError when
        what is needed is not there."""
        try:
            data = orjson.loads(raw)
            headers = [(str(k), _unb64(v)) for k, v in data.get("headers") or ()]
            timestamp = data.get("timestamp")
            return cls(str(data["topic"]), int(data["partition"]), int(data["offset"]),
                       _unb64(data.get("key")), base64.b64decode(data["value"]), headers,
                       float(timestamp) if timestamp is not None else None)  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a parked record: {exc!r}") from exc


def _b64(data: bytes | None) -> str | None:
    """Bytes in base64; None (a record without a key, a header without a value) as null."""
    return base64.b64encode(data).decode() if data is not None else None


def _unb64(text: str | None) -> bytes | None:
    return base64.b64decode(text) if text is not None else None


class Resumer:
    """Runs parked records again: `run(record)` answers one as the agent does (None:
    the worker is stopping)."""

    def __init__(
        self,
        store: TaskStore,
        slots: LaneSlots,
        run: Callable[[StoredRecord], Awaitable[Ended | None]],
    ) -> None:
        self.store = store
        self.run = run
        self.lane: BatchLane | None = None
        self._dispatcher = Dispatcher(slots=slots, lane=Lane.REPLAY)
        # result key -> None while it runs, or a newer record to run once it is done
        self._running: dict[str, bytes | None] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._owned: set[int] = set()

    def attach(self, lane: BatchLane) -> None:
        """The worker's batch lane: it says when a parked record may find its answer."""
        self.lane = lane
        lane.resume = self.resume
        self._resume_partitions(self.store.owned())

    def assigned(self, partitions: set[int]) -> None:
        """The worker owns exactly `partitions` now."""
        new, self._owned = partitions - self._owned, partitions
        if self.lane is not None:
            self.lane.keep(partitions)
            self._resume_partitions(new)

    def _resume_partitions(self, partitions: set[int]) -> None:
        lane = self.lane
        assert lane is not None

        async def resume(p: int) -> None:
            while p in self.store.owned():  # (`store.ready` would load one it lost again)
                if self.store.loaded(p):  # its ledger read
                    lane.resume_parked(p)
                    return
                await asyncio.sleep(0.2)

        for p in partitions:
            self._spawn(resume(p))

    def resume(self, partition: int, key: str, record: bytes) -> None:
        """The batch lane's word that parked record `key` may find its answer: run it
        again (once at a time; asked again meanwhile: once more after)."""
        if key in self._running:
            self._running[key] = record
            return
        self._running[key] = None
        self._spawn(self._dispatcher.submit(key, self._job(partition, key, record)))

    def _job(self, partition: int, key: str, record: bytes) -> Callable[[], Any]:
        async def job() -> None:
            raw: bytes | None = record
            try:
                while raw is not None and partition in self.store.owned():
                    try:
                        stored = StoredRecord.unpack(raw)
                    except ValueError as exc:  # left for a version that reads it
                        log.error("parked record %s of partition %d cannot be read, left in "
                                  "the ledger: %s", key, partition, exc)  # fmt: skip
                        return
                    kind = await self.run(stored)
                    if kind is None:
                        return  # stopping: run at the next start
                    if kind is Ended.RELEASED:
                        return  # its partition's new owner resumes it from the ledger
                    if kind is not Ended.PARKED:  # answered: the ledger forgets the record
                        try:
                            await self.store.put(Kind.LEDGER, partition, job_key(key), None)
                        except Exception as exc:  # run again next time: already done then
                            log.warning("could not delete parked record %s: %r", key, exc)
                    raw, self._running[key] = self._running.get(key), None
            finally:
                self._running.pop(key, None)

        return job

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._dispatcher.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


__all__ = ["Resumer", "StoredRecord"]
