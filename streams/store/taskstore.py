"""Task state and the answers the worker already has, kept beside the stream.

`TaskStore` holds five maps per task partition, each backed by a topic and
co-partitioned with the task topics (a task's entries live in the partition
its record came from), with a local copy (`store.local`: on disk by default,
read again only from its checkpoint on):

* results: result_key -> result record, backed by the results topic itself,
  so writing a result and recording it are one write;
* dead letters: dead-letter key -> dead-letter record, on the dead-letter topic;
* task state: task_id -> `TaskState` (status, keys, last error, history), on
  `<app_id>-task-state-changelog` (compacted);
* batch ledger: the batch lane's batches and requests (streams.core.batch),
  on `<app_id>-batch-ledger` (compacted);
* sessions: session id -> its turns (streams.core.sessions), on
  `<app_id>-sessions-changelog` (compacted).

At-least-once: the input offset commits only after these writes are acked, so
after a crash a record runs again, finds its answer and writes nothing more.

Standby replicas (`store_standby_replicas`): the partitions the group's assignor
makes this worker stand by for are followed into their on-disk copies (`standby`),
so that when one is assigned, its load reads only the last records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError

from streams.contract.records import kept
from streams.core.taskstate import TaskState
from streams.errors import NotOurs
from streams.kafka.limits import refused_for_good
from streams.kafka.topics import ledger_topic, sessions_topic, state_topic
from streams.observability.metrics import Metrics
from streams.resilience.retry import retry_transient
from streams.settings import Settings
from streams.store.local import MARK_EVERY_S, LocalStore, damaged
from streams.store.maps import Kind, Maps, now_ms
from streams.store.partition import Position, StorePartition
from streams.store.restore import follow_partition, load_partition, readable
from streams.store.retention import expire

log = logging.getLogger(__name__)

SAY_FLUSH_FAILURES_EVERY_S = 60.0


class _Ahead(Exception):
    """A standby's local copy is ahead of its topics (they were made again)."""


class PartitionLost(KafkaError, NotOurs):  # type: ignore[misc]  # aiokafka is untyped here
    """This worker no longer owns partition p (revoked, dropped after a fence, or fenced by
    its new owner): the record's outcome is left to the worker that owns p now."""


Send = Callable[
    [str, bytes, bytes | None, int, list[tuple[str, bytes]] | None], Awaitable[int | None]
]  # a write, returned once acked, with its offset (None: not known)


def store_topics(settings: Settings) -> dict[Kind, str]:
    """The topic that backs each map."""
    return {
        Kind.RESULTS: settings.topics.results,
        Kind.DEAD_LETTERS: settings.topics.dead_letters,
        Kind.TASK_STATES: state_topic(settings),
        Kind.LEDGER: ledger_topic(settings),
        Kind.SESSIONS: sessions_topic(settings),
    }


class TaskStore:
    """Answers and task states of the partitions this worker owns, backed by topics.

    Entry `key` of partition `p` lives in partition `p` of its topic: results in
    the results topic (keyed by result_key, compacted), dead letters in the
    dead-letter topic, task states in the task-state topic, the batch ledger in its
    topic. When the worker is assigned the task partition `p`, it reads what those
    topics gained since the checkpoint of its local copy (`store.local`: all of them
    for a new partition or `memory://`), before any record of `p` is answered
    (`ready`). Writes go to the topic, then to the local copy, whose checkpoint moves
    when they are flushed: every commit interval (at-least-once) or when their
    transaction commits (exactly-once).

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
        state_bytes: int = 1_044_000,
    ) -> None:
        self.settings = settings
        self.state_bytes = state_bytes  # bytes a task state may take on its topic
        self.topics = store_topics(settings)
        self._send = send
        self.metrics = metrics or Metrics()  # none given: one nobody scrapes
        self.local = LocalStore(rocks_dir(settings), settings.store_cache_mb << 20)
        # Exactly-once: the local copy takes only what committed (`committed`).
        self.transactional = settings.processing_guarantee == "exactly_once"
        self._parts: dict[int, StorePartition] = {}
        # Given away (revoked, or dropped after a fence) and not assigned again since: a
        # record of one is not this worker's to answer.
        self._gone: set[int] = set()
        self._flusher: asyncio.Task[None] | None = None
        self._written = asyncio.Event()  # a write ended since the flusher last woke
        # Set while the writes the disk refused stay under `store_unflushed_mb`: records
        # wait in `ready` meanwhile (replaced by a new one to wake them when a partition
        # leaves, so that its records learn it).
        self._room = asyncio.Event()
        self._room.set()
        self._unflushed_limit = settings.store_unflushed_mb << 20
        self._unflushed = 0  # as of the last failed flush, until one succeeds
        self._said_failure_at = -SAY_FLUSH_FAILURES_EVERY_S  # a failed flush, logged
        self._unsaid_failures = 0
        self._expirer: asyncio.Task[None] | None = None
        # Told when a partition's local copy is found damaged on a read or a flush (it is
        # dropped and deleted then): the worker starts the partition again (`worker.agent`).
        self.on_damaged: Callable[[int], Coroutine[Any, Any, None]] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Partitions this worker stands by for: their maps and the task following them.
        self._standbys: dict[int, tuple[Maps, asyncio.Task[None]]] = {}

    # -- ownership ---------------------------------------------------------------------

    def arriving(self, partitions: set[int]) -> None:
        """A rebalance gives the worker these partitions (its assignment is on its way, the
        producers of exactly-once first): their records are this worker's to answer."""
        self._gone -= partitions

    def assign(self, partitions: set[int]) -> None:
        """The worker now owns exactly these partitions: load new ones, let the rest go."""
        self._gone -= partitions
        for p in set(self._parts) - partitions:
            self._release(p, keep=not self.transactional)
            self._gone.add(p)
        for p in sorted(partitions - set(self._parts)):
            self._unfollow(p)  # a standby taken over: its warm copy opens as the active one
            part = StorePartition(self.local.open(p))
            self._parts[p] = part
            part.loading = asyncio.create_task(self._load(p, part), name=f"load-state-{p}")
        for p in self.local.stale(set(self._parts) | set(self._standbys),
                                  self.settings.store_cleanup_after_s):  # fmt: skip
            log.info("deleting the local store of partition %d (not owned for %.0fs)", p,
                     self.settings.store_cleanup_after_s)  # fmt: skip
            self.local.destroy(p)
        if self.local.base is not None and not self.transactional and self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_loop(), name="flush-state")
        if self._expirer is None:
            self._expirer = asyncio.create_task(self._expire_loop(), name="expire-state")

    def standby(self, partitions: set[int]) -> None:
        """The worker stands by for exactly these partitions (those it owns aside): follow
        new ones into their on-disk copies, stop following the rest (their copies stay on
        disk, for `store_cleanup_after_s`). memory:// keeps no copy: nothing to follow."""
        if self.local.base is None:
            return
        wanted = partitions - set(self._parts)
        for p in set(self._standbys) - wanted:
            self._unfollow(p)
        for p in sorted(wanted - set(self._standbys)):
            maps = self.local.open(p)
            task = asyncio.create_task(self._follow(p), name=f"standby-state-{p}")
            self._standbys[p] = (maps, task)
            log.info("standing by for partition %d (following its store's topics)", p)
        self.metrics.store_standbys.set(len(self._standbys))

    def standing_by(self) -> set[int]:
        return set(self._standbys)

    def _unfollow(self, p: int) -> None:
        """Stop following partition p, at once: the follower is cancelled before it runs
        again, and holds nothing on disk between its flushes (what it staged since goes; the
        next reader of p reads it from the topics)."""
        standby = self._standbys.pop(p, None)
        if standby is None:
            return
        maps, task = standby
        task.cancel()
        maps.discard()
        maps.close()
        self.local.release(p)
        self.metrics.store_standbys.set(len(self._standbys))

    async def _follow(self, partition: int) -> None:
        """Follow partition's topics until told to stop; while the broker is away, again."""

        def flushed(records: int) -> None:
            self.local.in_use(partition)
            self.metrics.standby_records.inc(records)

        async def follow() -> None:
            maps, _ = self._standbys[partition]
            await follow_partition(self.settings, self.topics, partition, maps,
                                   self._unreadable, flushed)  # fmt: skip
            raise _Ahead(partition)  # it returns only then: follow its topics from the start

        def again(exc: BaseException) -> bool:
            if isinstance(exc, _Ahead) or damaged(exc):
                what = "damaged" if damaged(exc) else "ahead of them (made again?)"
                log.warning("the local store of partition %d is %s: following its topics "
                            "from the start", partition, what)  # fmt: skip
                maps, task = self._standbys[partition]
                maps.close()
                self.local.destroy(partition)
                self._standbys[partition] = (self.local.open(partition), task)
            return isinstance(exc, Exception)

        await retry_transient(follow, what=f"following the store of partition {partition}",
                              transient=again, first_s=0.5, max_s=10.0,
                              sleep=asyncio.sleep)  # fmt: skip

    def _release(self, p: int, *, keep: bool) -> None:
        """Close a partition's maps: flushed first when `keep` (what is staged is then
        acked in its topic), else what is staged goes (an aborted or unknown transaction)."""
        part = self._parts.pop(p)
        if part.loading is not None:
            part.loading.cancel()
        if keep:
            self._flush(p, part)
        part.maps.discard()
        part.maps.close()
        self.local.release(p)
        part.gone = True
        part.ready.set()  # jobs waiting for it hear it is gone
        if not self._room.is_set():  # and those waiting for room: woken to hear it too
            woken, self._room = self._room, asyncio.Event()
            woken.set()
            self._gate()

    def drop(self, partition: int) -> None:
        """Forget a partition's writes since its last checkpoint (they may hold writes that
        never committed); its next assignment reads them again from the topics."""
        if partition in self._parts:
            self._release(partition, keep=False)
        self._gone.add(partition)

    def committed(self, partition: int) -> None:
        """Exactly-once: the partition's transaction committed; what it wrote is staged and
        goes to disk with the checkpoint."""
        part = self._parts.get(partition)
        if part is not None:
            self._flush(partition, part)

    def _flush(self, partition: int, part: StorePartition) -> None:
        """The staged writes and the checkpoint to disk; when the disk fails (full?), they
        stay staged for the next flush, a commit interval later (the topics hold them
        meanwhile), and past `store_unflushed_mb` records wait (`_gate`)."""
        if not part.ready.is_set():
            return  # loading: the loader flushes its own progress
        try:
            part.maps.flush(part.checkpoint())
            self.local.in_use(partition)
        except Exception as exc:
            if damaged(exc):  # no disk refusing: a copy that cannot be mended
                self._damaged(partition, exc)
                return
            self.metrics.store_flush_errors.inc()
            self._unsaid_failures += 1
            now = time.monotonic()
            if now - self._said_failure_at >= SAY_FLUSH_FAILURES_EVERY_S:
                # Tried again every commit interval for every partition: said once a
                # minute, not twice a second per partition (on a disk that may be full).
                log.exception("could not write the local store of partition %d (%d failed "
                              "flushes since the last word)", partition,
                              self._unsaid_failures)  # fmt: skip
                self._said_failure_at, self._unsaid_failures = now, 0
            self._written.set()  # at-least-once: the flusher tries again next interval
            self._gate()
            return
        if self._unflushed:  # what the disk refused before may be on it now
            self._gate()

    def _damaged(self, partition: int, exc: BaseException) -> None:
        """RocksDB says partition's local copy is damaged (a block that fails its checksum,
        a table gone): read on, it failed every record's read and every flush for good —
        records dead-lettered as bugs, the flush retried as a full disk. It is dropped and
        deleted, and `on_damaged` starts the partition again: its records run again from
        the committed offsets once its topics are read into a new copy."""
        if partition not in self._parts:
            return  # given away meanwhile (its next reader meets the damage at its open)
        log.error("the local store of partition %d is damaged (%s): deleting it; the partition "
                  "starts again from its committed offsets, its topics read again", partition,
                  exc)  # fmt: skip
        self.drop(partition)
        self.local.destroy(partition)
        if self.on_damaged is not None:
            task = asyncio.get_running_loop().create_task(self.on_damaged(partition))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _read_failed(self, partition: int, exc: Exception) -> None:
        """A read of partition's local copy raised `exc`: PartitionLost when the copy is
        damaged (the record is left to the partition's start again), else nothing."""
        if damaged(exc):
            self._damaged(partition, exc)
            raise PartitionLost(f"the local store of partition {partition} is damaged: "
                                "read again before its records run") from exc  # fmt: skip

    def _gate(self) -> None:
        """Records wait before they run while the writes the disk refused pass
        `store_unflushed_mb` (memory would grow with every task until the worker is
        killed), and go on once flushes bring them under it. Dropping those writes instead
        would forget answers a redelivered task must find: it would be paid twice."""
        self._unflushed = unflushed = sum(part.maps.unflushed() for part in self._parts.values())
        self.metrics.store_unflushed.set(unflushed)
        if unflushed > self._unflushed_limit and self._room.is_set():
            log.error("the task store holds %d MB its disk refused (store_unflushed_mb=%d): "
                      "records wait until it writes again", unflushed >> 20,
                      self.settings.store_unflushed_mb)  # fmt: skip
            self._room.clear()
        elif unflushed <= self._unflushed_limit and not self._room.is_set():
            log.warning("the task store's disk takes its writes again: records go on")
            self._room.set()

    async def ready(self, partition: int) -> None:
        """Wait until partition's entries are loaded (at once when they are; a partition
        whose assignment has not reached the store yet is loaded now). Raises
        PartitionLost when the partition was given away (revoked, or dropped after a
        fence) and not assigned again, or is given away while it loads: one answered for a
        dropped partition would have its writes thrown away. Its new owner (or this
        worker, assigned it again) runs it."""
        part = self._parts.get(partition)
        if part is None and partition in self._gone:
            raise PartitionLost(f"partition {partition} is not this worker's")
        if part is None:  # assigned, its signal not here yet: load it now, not answer blind
            self.assign(set(self._parts) | {partition})
            part = self._parts[partition]
        await part.ready.wait()
        while not part.gone and not self._room.is_set():  # the disk refuses writes (`_gate`)
            await self._room.wait()
        if part.gone:
            raise PartitionLost(f"partition {partition} was given away while it loaded")

    def disk_refusing(self) -> bool:
        """Records wait: the writes the disk refused are past `store_unflushed_mb`."""
        return not self._room.is_set()

    def loaded(self, partition: int) -> bool:
        part = self._parts.get(partition)
        return part is not None and part.ready.is_set()

    def owned(self) -> set[int]:
        return set(self._parts)

    async def close(self) -> None:
        followers = [task for _, task in self._standbys.values()]
        for p in list(self._standbys):
            self._unfollow(p)
        await asyncio.gather(*followers, return_exceptions=True)
        loops = [task for task in (self._flusher, self._expirer) if task is not None]
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        self._flusher = self._expirer = None
        loading = [part.loading for part in self._parts.values() if part.loading is not None]
        for task in loading:
            task.cancel()
        await asyncio.gather(*loading, return_exceptions=True)
        for p in list(self._parts):
            self._release(p, keep=not self.transactional)

    async def _flush_loop(self) -> None:
        """At-least-once: what was written goes to disk within a commit interval. While
        nothing is written the loop sleeps (an idle worker woke for it twice a second),
        waking once every `MARK_EVERY_S` for the partitions' last-used marks."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(MARK_EVERY_S):
                    await self._written.wait()
            self._written.clear()
            await asyncio.sleep(self.settings.kafka.commit_interval_s)
            for p, part in list(self._parts.items()):
                self._flush(p, part)

    # -- retention ----------------------------------------------------------------------

    async def _expire_loop(self) -> None:
        """Every `retention.check_s`: what is past its map's retention goes, and the maps'
        sizes are reported."""
        while True:
            await asyncio.sleep(self.settings.retention.check_s)
            for p, part in list(self._parts.items()):
                if part.ready.is_set() and self.settings.retention.limits():
                    try:
                        await self.expire(p)
                    except Exception as exc:  # the broker away, the partition lost: next round
                        if damaged(exc):
                            self._damaged(p, exc)
                            continue
                        log.warning("expiring entries of partition %d failed", p, exc_info=True)
            for kind in Kind:
                total = sum(part.maps.count(kind) for part in self._parts.values())
                self.metrics.store_entries.labels(kind.value).set(total)

    async def expire(self, partition: int, now: int | None = None) -> dict[Kind, int]:
        """Delete `partition`'s entries past their map's retention (see
        `store.retention.expire`); how many went, per map."""
        part = self._parts.get(partition)
        if part is None or not part.ready.is_set():
            return {}
        return await expire(
            part, partition, self.settings.retention.limits(), self.put, self.metrics,
            still=lambda: self._parts.get(partition) is part, now=now,
        )  # fmt: skip

    async def _load(self, partition: int, part: StorePartition) -> None:
        started = time.monotonic()
        counts = await self._read(partition, part)
        if counts is None:  # the local copy is ahead of its topics: they were made again
            log.warning("the local store of partition %d is ahead of its topics (deleted and "
                        "made again?): reading them from the start", partition)  # fmt: skip
            part.maps.close()
            self.local.destroy(partition)
            part.maps = self.local.open(partition)
            counts = await self._read(partition, part) or {}
        checkpoint = part.maps.checkpoint()
        for kind, position in part.positions.items():
            position.top = checkpoint[kind]
        log.info("state of partition %d loaded in %.2fs: %s records read (from %s)", partition,
                 time.monotonic() - started, {k.value: n for k, n in counts.items()},
                 "its checkpoint" if part.maps.persistent else "offset 0")  # fmt: skip
        for kind, n in counts.items():
            self.metrics.state_loaded.labels(kind.value).inc(n)
        part.loading = None
        part.ready.set()

    async def _read(self, partition: int, part: StorePartition) -> dict[Kind, int] | None:
        """What the topics gained since the local checkpoint, read into the maps; while
        the broker is away, again (the partition's records wait) until revoked."""

        async def load() -> dict[Kind, int] | None:
            try:
                return await load_partition(self.settings, self.topics, partition, part.maps,
                                            self._unreadable)  # fmt: skip
            except Exception as exc:
                if damaged(exc):  # read again from the start into a new copy (tried again)
                    log.error("the local store of partition %d is damaged (%s): deleting it "
                              "and reading its topics from the start", partition, exc)  # fmt: skip
                    part.maps.close()
                    self.local.destroy(partition)
                    part.maps = self.local.open(partition)
                raise

        return await retry_transient(
            load, what=f"loading state of partition {partition}",
            transient=lambda exc: isinstance(exc, Exception), first_s=0.5, max_s=10.0,
            sleep=asyncio.sleep,
        )  # fmt: skip

    def _unreadable(self, kind: Kind, record: Any) -> None:
        log.warning(
            "skipping a %s record this version cannot read at %s/%d/%d (written by a newer "
            "version, or not by llm-streams): %r",
            kind.value, record.topic, record.partition, record.offset, record.value[:200],
        )  # fmt: skip
        self.metrics.store_unreadable.labels(kind.value).inc()

    # -- reads and writes --------------------------------------------------------------

    def get(self, kind: Kind, partition: int, key: bytes) -> bytes | None:
        part = self._parts.get(partition)
        if part is None:
            return None
        try:
            return part.maps.get(kind, key)
        except Exception as exc:
            self._read_failed(partition, exc)
            raise

    def keys(self, kind: Kind, partition: int, prefix: bytes) -> list[bytes]:
        part = self._parts.get(partition)
        if part is None:
            return []
        try:
            return part.maps.keys(kind, prefix)
        except Exception as exc:
            self._read_failed(partition, exc)
            raise

    def result(self, partition: int, result_key: str) -> bytes | None:
        return self.get(Kind.RESULTS, partition, result_key.encode())

    def dead_letter(self, partition: int, key: str) -> bytes | None:
        return self.get(Kind.DEAD_LETTERS, partition, key.encode())

    def state(self, partition: int, task_id: str) -> TaskState | None:
        raw = self.get(Kind.TASK_STATES, partition, task_id.encode())
        return TaskState.loads(raw) if raw is not None else None

    async def put(
        self,
        kind: Kind,
        partition: int,
        key: bytes,
        value: bytes | None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Write to the topic (None: a tombstone), and once the broker has it, to the map."""
        part = self._parts.get(partition)
        position = part.positions[kind] if part is not None else None
        ticket = position.begin(key) if position is not None else 0
        try:
            offset = await self._send(self.topics[kind], key, value, partition, headers)
        except BaseException as exc:
            if position is None:
                pass
            elif refused_for_good(exc) is not None:
                # Refused (too large, invalid, not authorised): not in the topic. Held as
                # uncertain, it held the checkpoint until its key was written again —
                # a refused result's never is: every restart read the partition again
                # from there, a year of it after a year.
                position.done(ticket, None)
            else:
                position.failed(ticket)  # it may be in the topic all the same
            raise
        finally:
            self._written.set()  # the flusher wakes: a checkpoint or a staged entry moved
        if position is not None:
            position.done(ticket, offset)
        if part is not None and self._parts.get(partition) is part:  # still ours
            part.maps.stage(kind, key, kept(value) if value is not None else None, now_ms())

    async def put_state(self, partition: int, state: TaskState) -> None:
        value = state.dumps_within(self.state_bytes)
        await self.put(Kind.TASK_STATES, partition, state.task_id.encode(), value)


class MapView:
    """One map of the store, as the core sees it (`core.batch.Ledger`). `durable`: waits
    until what was written to a partition can no longer be undone (exactly-once: the
    partition's transaction committed); none: a write the broker acked is durable."""

    def __init__(
        self,
        store: TaskStore,
        kind: Kind,
        durable: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.store, self.kind = store, kind
        self._durable = durable

    def get(self, partition: int, key: bytes) -> bytes | None:
        return self.store.get(self.kind, partition, key)

    async def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        await self.store.put(self.kind, partition, key, value)

    async def durable(self, partition: int) -> None:
        if self._durable is not None:
            await self._durable(partition)

    def keys(self, partition: int, prefix: bytes) -> list[bytes]:
        return self.store.keys(self.kind, partition, prefix)

    def owns(self, partition: int) -> bool:
        return partition in self.store.owned()


def rocks_dir(settings: Settings) -> Path | None:
    """Where the maps live on disk (`LLM_STREAMS_STORE=rocksdb://[path]`), or None: memory."""
    if not settings.store.startswith("rocksdb://"):
        return None
    path = settings.store.removeprefix("rocksdb://")
    return Path(path) if path else settings.data_dir / "store"


__all__ = ["Kind", "MapView", "Position", "TaskStore", "load_partition", "readable"]
