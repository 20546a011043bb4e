"""Task state and the answers the worker already has, kept beside the stream.

`TaskStore` holds three maps per task partition, each backed by a topic and
co-partitioned with the task topics (a task's entries live in the partition
its record came from):

* results: result_key -> result record, backed by the results topic itself,
  so writing a result and recording it are one write;
* dead letters: dead-letter key -> dead-letter record, on the dead-letter topic;
* task state: task_id -> `TaskState` (status, keys, last error, history), on
  `<app_id>-task-state-changelog` (compacted);
* batch ledger: the batch lane's batches and requests (streams.core.batches),
  on `<app_id>-batch-ledger` (compacted).

At-least-once: the input offset commits only after these writes are acked, so
after a crash a record runs again, finds its answer and writes nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from enum import StrEnum
from pathlib import Path
from typing import Any

import orjson
from aiokafka import TopicPartition
from pydantic import ValidationError

from streams.core.taskstate import TaskState
from streams.kafka.clients import reader
from streams.kafka.scan import end_offsets, read_range
from streams.kafka.topics import ledger_topic, state_topic
from streams.observability.metrics import Metrics
from streams.resilience.retry import retry_transient
from streams.settings import Settings

log = logging.getLogger(__name__)


class Kind(StrEnum):
    """The maps of the store, each backed by its own topic."""

    RESULTS = "results"
    DEAD_LETTERS = "dead_letters"
    TASKS = "tasks"
    LEDGER = "ledger"  # the batch lane's batches and their requests


Send = Callable[[str, bytes, bytes, int, list[tuple[str, bytes]] | None], Awaitable[None]]


class TaskStore:
    """Answers and task states of the partitions this worker owns, backed by topics.

    Entry `key` of partition `p` lives in partition `p` of its topic: results in
    the results topic (keyed by result_key, compacted), dead letters in the
    dead-letter topic, task states in the task-state topic. The worker reads a
    partition's three topics to their end when it is assigned the task
    partition `p`, before any record of `p` is answered (`ready`), and drops
    them when `p` goes to another worker.

    Faust tables would do the same, but their recovery (faust-streaming 0.15.3)
    interleaves with the agent's fetches and, after a restart, now and then
    skips a run of task records and commits past them: a lost task. This store
    reads with its own consumer and never touches the group's consumer.
    """

    def __init__(
        self,
        settings: Settings,
        send: Send,
        metrics: Metrics | None = None,
        *,
        state_room: int = 1_044_000,
    ) -> None:
        self.settings = settings
        self.state_room = state_room  # bytes a task state may take on its topic
        self.topics = {
            Kind.RESULTS: settings.topics.results,
            Kind.DEAD_LETTERS: settings.topics.dead_letters,
            Kind.TASKS: state_topic(settings),
            Kind.LEDGER: ledger_topic(settings),
        }
        self._send = send
        self.metrics = metrics or Metrics()  # none given: one nobody scrapes
        self._maps: dict[int, dict[Kind, Map]] = {}
        self._rocks_dir = rocks_dir(settings)
        self._ready: dict[int, asyncio.Event] = {}
        self._loading: dict[int, asyncio.Task[None]] = {}

    # -- ownership ---------------------------------------------------------------------

    def assign(self, partitions: set[int]) -> None:
        """The worker now owns exactly these partitions: load new ones, drop the rest."""
        for p in set(self._maps) - partitions:
            task = self._loading.pop(p, None)
            if task is not None:
                task.cancel()
            close_maps(self._maps.pop(p))
            self._ready.pop(p, None)
        for p in sorted(partitions - set(self._maps)):
            self._maps[p] = open_maps(self._rocks_dir, p)
            self._ready[p] = asyncio.Event()
            self._loading[p] = asyncio.create_task(self._load(p), name=f"load-state-{p}")

    def drop(self, partition: int) -> None:
        """Forget a partition's entries (they may hold writes that never committed); its
        next assignment reads them again from the topics."""
        self.assign(set(self._maps) - {partition})

    async def ready(self, partition: int) -> None:
        """Wait until partition's entries are loaded (at once when they are)."""
        event = self._ready.get(partition)
        if event is None:  # not assigned (yet): load it now rather than answer blind
            self.assign(set(self._maps) | {partition})
            event = self._ready[partition]
        await event.wait()

    def owned(self) -> set[int]:
        return set(self._maps)

    async def close(self) -> None:
        for task in self._loading.values():
            task.cancel()
        await asyncio.gather(*self._loading.values(), return_exceptions=True)
        self._loading.clear()
        for maps in self._maps.values():
            close_maps(maps)
        self._maps.clear()
        self._ready.clear()

    async def _load(self, partition: int) -> None:
        maps = self._maps[partition]
        started = time.monotonic()

        async def load() -> dict[Kind, int]:
            return await load_partition(self.settings, self.topics, partition, maps,
                                        self._unreadable)  # fmt: skip

        # The broker away: keep trying (the partition's records wait) until revoked.
        counts = await retry_transient(
            load, what=f"loading state of partition {partition}",
            transient=lambda exc: isinstance(exc, Exception), first_s=0.5, max_s=10.0,
            sleep=asyncio.sleep,
        )  # fmt: skip
        log.info("state of partition %d loaded in %.2fs: %s", partition,
                 time.monotonic() - started, counts)  # fmt: skip
        for kind, n in counts.items():
            self.metrics.state_loaded.labels(kind.value).inc(n)
        self._loading.pop(partition, None)
        self._ready[partition].set()

    def _unreadable(self, kind: Kind, record: Any) -> None:
        log.warning(
            "skipping a %s record this version cannot read at %s/%d/%d (written by a newer "
            "version, or not by llm-streams): %r",
            kind.value, record.topic, record.partition, record.offset, record.value[:200],
        )  # fmt: skip
        self.metrics.store_unreadable.labels(kind.value).inc()

    # -- reads and writes --------------------------------------------------------------

    def get(self, kind: Kind, partition: int, key: bytes) -> bytes | None:
        maps = self._maps.get(partition)
        return maps[kind].get(key) if maps is not None else None

    def result(self, partition: int, result_key: str) -> bytes | None:
        return self.get(Kind.RESULTS, partition, result_key.encode())

    def dead_letter(self, partition: int, key: str) -> bytes | None:
        return self.get(Kind.DEAD_LETTERS, partition, key.encode())

    def state(self, partition: int, task_id: str) -> TaskState | None:
        raw = self.get(Kind.TASKS, partition, task_id.encode())
        return TaskState.loads(raw) if raw is not None else None

    async def put(
        self,
        kind: Kind,
        partition: int,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Write to the topic, and once the broker has it, to the map."""
        await self._send(self.topics[kind], key, value, partition, headers)
        maps = self._maps.get(partition)
        if maps is not None:  # still ours
            # A copy: bytes made by orjson.dumps keep about 4 KB of memory each however
            # short they are (measured: 4.2 KB per 335-byte value vs 0.46 KB copied).
            maps[kind][key] = bytes(memoryview(value))

    async def put_state(self, partition: int, state: TaskState) -> None:
        value = state.dumps_within(self.state_room)
        await self.put(Kind.TASKS, partition, state.task_id.encode(), value)


class MapView:
    """One map of the store, as the core sees it (`core.batches.Ledger`)."""

    def __init__(self, store: TaskStore, kind: Kind) -> None:
        self.store, self.kind = store, kind

    def get(self, partition: int, key: bytes) -> bytes | None:
        return self.store.get(self.kind, partition, key)

    async def put(self, partition: int, key: bytes, value: bytes) -> None:
        await self.store.put(self.kind, partition, key, value)


Map = MutableMapping[bytes, bytes]


def rocks_dir(settings: Settings) -> Path | None:
    """Where the maps live on disk (`LLM_STREAMS_STORE=rocksdb://[path]`), or None: memory."""
    if not settings.store.startswith("rocksdb://"):
        return None
    path = settings.store.removeprefix("rocksdb://")
    return Path(path) if path else settings.data_dir / "store"


def open_maps(base: Path | None, partition: int) -> dict[Kind, Map]:
    """Empty maps for a partition: dicts, or RocksDB files (rocksdict) emptied first, since
    the topics are the truth and are read again on every assignment."""
    if base is None:
        return {kind: {} for kind in Kind}
    from rocksdict import Options, Rdict

    maps: dict[Kind, Map] = {}
    for kind in Kind:
        path = base / f"p{partition}-{kind.value}"
        if path.exists():
            Rdict.destroy(str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        # raw_mode: keys and values are our bytes as they are (no pickling).
        maps[kind] = Rdict(str(path), options=Options(raw_mode=True))  # type: ignore[assignment]  # Rdict has the mapping methods used here but is no MutableMapping subclass
    return maps


def close_maps(maps: dict[Kind, Map]) -> None:
    for m in maps.values():
        close = getattr(m, "close", None)
        if close is not None:
            close()


def readable(kind: Kind, value: bytes) -> bool:
    """Can this version use a stored value of map `kind`? Unknown fields are fine (a newer
    version wrote them); a value without what the worker reads from it is not."""
    try:
        if kind is Kind.TASKS:
            TaskState.loads(value)
            return True
        data = orjson.loads(value)
    except (orjson.JSONDecodeError, ValidationError, TypeError, ValueError):
        return False
    if not isinstance(data, dict):
        return False
    if kind is Kind.RESULTS:
        return (
            isinstance(data.get("output"), dict)
            and isinstance(data.get("model"), str)
            and isinstance(data.get("attempts", 0), int)
        )
    if kind is Kind.DEAD_LETTERS:
        error = data.get("error")
        return isinstance(error, dict) and isinstance(data.get("attempts", 0), int)
    return True


async def load_partition(
    settings: Settings,
    topics: dict[Kind, str],
    partition: int,
    maps: dict[Kind, Map],
    on_unreadable: Callable[[Kind, Any], None] | None = None,
) -> dict[Kind, int]:
    """Read partition `partition` of each topic from its start to its real end into `maps`
    (latest value per key; a null value deletes; a value this version cannot read is
    skipped and reported to `on_unreadable`). Returns records read per kind."""
    consumer = reader(
        settings, "state", client_id=f"{settings.app_id}-state-{partition}",
        max_partition_fetch_bytes=4 * 1024 * 1024,
    )  # fmt: skip
    await consumer.start()
    try:
        kind_of = {TopicPartition(topic, partition): kind for kind, topic in topics.items()}
        tps = list(kind_of)
        ends = await end_offsets(consumer, tps)
        counts = dict.fromkeys(topics, 0)
        async for records in read_range(consumer, dict.fromkeys(tps, 0), ends):
            kind = kind_of[TopicPartition(records[0].topic, records[0].partition)]
            target = maps[kind]
            counts[kind] += len(records)
            for record in records:
                if record.key is None:
                    continue
                if record.value is None:
                    if record.key in target:
                        del target[record.key]
                elif readable(kind, record.value):
                    target[record.key] = record.value
                elif on_unreadable is not None:
                    on_unreadable(kind, record)
        return counts
    finally:
        await consumer.stop()


__all__ = ["Kind", "MapView", "TaskStore", "load_partition", "readable"]
