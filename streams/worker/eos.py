"""Exactly-once: every write of a task partition and its input offsets in one Kafka
transaction (`LLM_STREAMS_PROCESSING_GUARANTEE=exactly_once`, Apache Kafka only).

Per owned task partition p, a transactional producer (`transactional.id` =
`<app_id>-eos-<p>`). Starting it fences any older producer of p — a worker that
lost p without knowing it can no longer write there. Every write for p
(results, dead letters, task states, the batch ledger, reviews) goes into p's
open transaction. The offsets Faust finds safe to commit for the input topics'
partition p (the in-order acknowledged watermark of the live and replay topics)
are not committed by Faust's consumer: they are recorded and sent with p's
transaction (`send_offsets_to_transaction`), which commits every commit
interval. So a read_committed reader sees a task's outcome exactly when its
input offset is committed too, or sees neither.

What the transactions leave to the task store: a result can commit a transaction
or two before its record's offset (records finish out of order). If the worker
dies in between, the record runs again, finds its committed result in the store
(read with read_committed) and writes nothing. Writes that were in flight at a
crash are aborted with their transaction and never seen.

Faust 0.15.3's own exactly-once mode runs a transaction per source partition
around Faust's producer; the worker's writes come from concurrent jobs through
the task store, so they are kept here instead, and Faust runs at-least-once
with its offset commit routed here (`hook_consumer`: the one private Faust
attribute this module touches).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextvars import ContextVar
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import IllegalOperation, ProducerFenced

from streams.errors import ConfigError
from streams.kafka import clients
from streams.settings import Settings
from streams.store.taskstore import PartitionLost
from streams.worker import faust_private

log = logging.getLogger(__name__)

# The task partitions whose transaction the current write is held in (`Transactions.held`):
# its sends go in at once, where others wait for the commit under way (which waits for
# the hold). Tasks started inside a hold (the writer's gathered writes) are in it too.
# Set and read here only.
_HELD: ContextVar[frozenset[int]] = ContextVar("llm_streams_eos_held", default=frozenset())


async def _stopped(producer: AIOKafkaProducer, partition: int) -> None:
    """A producer that did not start, stopped: its connections and background tasks
    (a started client's metadata refresh, its sender) would stay for the worker's life, one
    more each time the partition's start fails or is cancelled. Shielded: a cancellation
    does not cut the stop short."""
    try:
        await asyncio.shield(producer.stop())
    except Exception:
        log.exception("exactly-once: could not stop the producer of partition %d", partition)
    except asyncio.CancelledError:
        pass  # cancelled again: the stop goes on, shielded


class _Partition:
    """One task partition's producer and its open transaction."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self.open = asyncio.Event()  # set while sends may enter the transaction
        self.sending = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.offsets: dict[TopicPartition, int] = {}
        self.writes = 0  # since the transaction began
        self.lock = asyncio.Lock()  # one commit at a time
        self.lost = False
        # True when the open transaction commits, False if it never will.
        self.next_commit: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def committed(self) -> None:
        done, self.next_commit = self.next_commit, asyncio.get_running_loop().create_future()
        done.set_result(True)

    def gone(self) -> None:
        self.lost = True
        self.open.set()  # waiting sends see it is lost
        if not self.next_commit.done():
            self.next_commit.set_result(False)


class Transactions:
    """The transactional producers of the partitions this worker owns."""

    def __init__(
        self,
        settings: Settings,
        on_error: Callable[[BaseException], Awaitable[None]] | None = None,
        on_fenced: Callable[[int], Coroutine[Any, Any, None]] | None = None,
        on_committed: Callable[[int], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_error = on_error
        # Told when partition p's transaction committed, before the next one opens: what
        # it wrote is then durable (the task store's local copy takes it).
        self.on_committed = on_committed
        # Told when a partition's producer is fenced: by its new owner (a rebalance is
        # on its way), or with no takeover at all (the transaction timed out) — then the
        # worker must start the partition again from its committed offsets.
        self.on_fenced = on_fenced
        self._tasks: set[asyncio.Task[None]] = set()
        self.group_id = settings.app_id
        self._parts: dict[int, _Partition] = {}
        self._starting: dict[int, asyncio.Task[None]] = {}
        self._committer: asyncio.Task[None] | None = None

    def transactional_id(self, partition: int) -> str:
        return f"{self.settings.app_id}-eos-{partition}"

    # -- ownership -----------------------------------------------------------------------

    async def assign(self, partitions: set[int]) -> None:
        """Own exactly `partitions`: commit and close the others, start the new ones."""
        for p in sorted(set(self._parts) - partitions):
            part = self._parts.pop(p)
            await self._close(p, part, commit=not part.lost)
        started = []
        for p in sorted(partitions - set(self._parts) - set(self._starting)):
            self._starting[p] = asyncio.create_task(self._start(p))
            started.append(self._starting[p])
        if started:
            await asyncio.gather(*started)
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_loop())

    async def _start(self, partition: int) -> None:
        try:
            producer = clients.producer(
                self.settings,
                transactional_id=self.transactional_id(partition),
                enable_idempotence=True,
                acks="all",
                linger_ms=5,
                client_id=f"{self.settings.app_id}-eos-{partition}",
            )
            try:
                await producer.start()  # InitProducerId: fences the older producer of p
                await producer.begin_transaction()
            except BaseException:  # refused, or the rebalance cancelled it: none left open
                await _stopped(producer, partition)
                raise
            part = _Partition(producer)
            part.open.set()
            self._parts[partition] = part
            log.info("exactly-once: producer of partition %d ready", partition)
        finally:
            self._starting.pop(partition, None)

    def _fenced(self, partition: int, part: _Partition) -> None:
        """Partition's producer was fenced: its open transaction is aborted, nothing more
        is written there, and `on_fenced` hears of it (once)."""
        if part.lost:
            return
        part.gone()
        log.warning("exactly-once: the producer of partition %d was fenced", partition)
        if self.on_fenced is not None:
            task: asyncio.Task[None] = asyncio.create_task(self.on_fenced(partition))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def forget(self, partition: int) -> None:
        """Drop a fenced partition's producer: the next assignment of it starts a new one."""
        part = self._parts.pop(partition, None)
        if part is not None:
            await self._close(partition, part, commit=False)

    async def ready(self, partition: int) -> None:
        starting = self._starting.get(partition)
        if starting is not None:
            await asyncio.shield(starting)

    @contextlib.asynccontextmanager
    async def held(self, partition: int) -> AsyncIterator[None]:
        """Writes made inside go into one transaction of `partition`: its commit waits for
        the hold to end, so one outcome's writes — its result, its sink record, the task's
        state — commit together or not at all (a commit between them, then a crash, would
        leave a result and a sink record without the state that says so, and the record's
        next run would write its sink record a second time)."""
        await self.ready(partition)
        part = self._parts.get(partition)
        if part is None or part.lost:  # not this worker's: the writes inside are told so
            yield
            return
        await part.open.wait()
        part.sending += 1
        part.idle.clear()
        token = _HELD.set(_HELD.get() | {partition})
        try:
            yield
        finally:
            _HELD.reset(token)
            part.sending -= 1
            if part.sending == 0:
                part.idle.set()

    async def durable(self, partition: int) -> None:
        """Return once what was written so far into partition's transaction is committed;
        raise PartitionLost if it never will be."""
        await self.ready(partition)
        part = self._parts.get(partition)
        if part is None or part.lost:
            raise PartitionLost(f"partition {partition} is not this worker's")
        if not part.writes and part.open.is_set():
            return  # nothing written since the last commit
        if not await asyncio.shield(part.next_commit):
            raise PartitionLost(f"partition {partition}: its transaction did not commit")

    def owns(self, partition: int) -> bool:
        part = self._parts.get(partition)
        return part is not None and not part.lost

    # -- writes and offsets --------------------------------------------------------------

    async def send(
        self,
        topic: str,
        key: bytes,
        value: bytes | None,
        partition: int,
        headers: list[tuple[str, bytes]] | None = None,
        *,
        via: int | None = None,
    ) -> int:
        """A write to `partition` of `topic` in the open transaction of task partition
        `via` (default: `partition` itself), returned with its offset once the broker has
        it (readable by read_committed readers once the transaction commits)."""
        owner = partition if via is None else via
        await self.ready(owner)
        part = self._parts.get(owner)
        if part is None or part.lost:
            raise PartitionLost(f"partition {owner} is not this worker's")
        if owner not in _HELD.get():  # held: the commit waits for this write's hold
            await part.open.wait()
        if part.lost:
            raise PartitionLost(f"partition {owner} is not this worker's")
        part.sending += 1
        part.idle.clear()
        try:
            _unless_failed(part.producer)
            delivery = await part.producer.send(
                topic, key=key, value=value, partition=partition, headers=headers
            )
            part.writes += 1
        except (ProducerFenced, IllegalOperation) as exc:
            # IllegalOperation: aiokafka refusing a send into a producer that failed for
            # good while the send waited (its sender died fenced); the kept error says why.
            if not _fenced(part.producer, exc):
                raise
            self._fenced(owner, part)
            raise PartitionLost(f"partition {owner}: fenced") from exc
        finally:
            part.sending -= 1
            if part.sending == 0:
                part.idle.set()
        try:
            metadata = await delivery
        except ProducerFenced as exc:
            self._fenced(owner, part)
            raise PartitionLost(f"partition {owner}: fenced") from exc
        return int(metadata.offset)

    def record_offsets(self, offsets: Mapping[Any, int]) -> bool:
        """Faust's safe offsets (its TP -> next offset), kept for the partition's next
        commit instead of a consumer commit. True: Faust may count them committed."""
        for tp, offset in offsets.items():
            part = self._parts.get(tp.partition)
            if part is not None and not part.lost:
                part.offsets[TopicPartition(tp.topic, tp.partition)] = offset
        return True

    def hook_consumer(self, consumer: Any) -> None:
        """Route Faust's offset commits of the task topics into the transactions; those of
        source topics (a pipeline's `source:`, whose partitions are no task partitions)
        are committed by Faust as at-least-once: their records' forwards are written
        outside the transactions, and a forward made twice is answered once (see
        `worker.sources`)."""
        inputs = {self.settings.topics.tasks, self.settings.topics.replay}

        async def commit(offsets: Mapping[Any, int], own: faust_private.Commit) -> bool:
            tasks = {tp: o for tp, o in offsets.items() if tp.topic in inputs}
            others = {tp: o for tp, o in offsets.items() if tp.topic not in inputs}
            recorded = self.record_offsets(tasks)
            return (await own(others) if others else True) and recorded

        faust_private.route_commits(consumer, commit)

    # -- commits -------------------------------------------------------------------------

    async def _commit_loop(self) -> None:
        interval = self.settings.kafka.commit_interval_s
        while True:
            await asyncio.sleep(interval)
            for p, part in list(self._parts.items()):
                try:
                    await self.commit(p, part)
                except PartitionLost:
                    pass  # told to on_fenced
                except Exception as exc:  # the transaction state is unknown: stop the worker
                    log.exception("exactly-once: commit of partition %d failed", p)
                    if self.on_error is not None:
                        await self.on_error(exc)
                    raise

    async def commit(self, partition: int, part: _Partition, *, reopen: bool = True) -> None:
        """Commit p's transaction with the offsets recorded for p, then open the next."""
        async with part.lock:
            if part.lost:
                return
            if not part.offsets and not part.writes:
                # Nothing to commit: all the partition wrote is committed, so the store's
                # local copy may take it (a flush its disk refused is tried again here).
                if self.on_committed is not None:
                    self.on_committed(partition)
                return
            part.open.clear()  # new sends wait for the next transaction
            try:
                await part.idle.wait()
                offsets, part.offsets = part.offsets, {}
                if offsets:
                    _unless_failed(part.producer)
                    await part.producer.send_offsets_to_transaction(offsets, self.group_id)
                _unless_failed(part.producer)
                await part.producer.commit_transaction()
                part.writes = 0
                part.committed()
                if self.on_committed is not None:
                    self.on_committed(partition)
                if reopen:
                    _unless_failed(part.producer)
                    await part.producer.begin_transaction()
            except ProducerFenced as exc:
                self._fenced(partition, part)
                raise PartitionLost(f"partition {partition}: fenced") from exc
            finally:
                if reopen:
                    part.open.set()

    async def _close(self, partition: int, part: _Partition, *, commit: bool) -> None:
        try:
            if commit:
                await self.commit(partition, part, reopen=False)
        except Exception as exc:
            log.warning("exactly-once: last commit of partition %d failed: %r", partition, exc)
        finally:
            part.gone()
            try:
                await part.producer.stop()
            except Exception as exc:  # its sender died of it (fenced): gone all the same
                log.info("exactly-once: the producer of partition %d stopped with %r",
                         partition, exc)  # fmt: skip

    async def close(self) -> None:
        if self._committer is not None:
            self._committer.cancel()
            await asyncio.gather(self._committer, return_exceptions=True)
        for p, part in list(self._parts.items()):
            await self._close(p, part, commit=not part.lost)
        self._parts.clear()


def _fenced(producer: AIOKafkaProducer, exc: BaseException) -> bool:
    """`exc`, raised by a call on `producer`, means a newer producer of its partition fenced
    it (directly, or as what ended the producer for good)."""
    return isinstance(exc, ProducerFenced) or isinstance(
        faust_private.transaction_failed(producer), ProducerFenced
    )


def _unless_failed(producer: AIOKafkaProducer) -> None:
    """Raise what ended `producer` for good (fenced: `ProducerFenced`), before a
    transaction call that would otherwise fail an assertion of aiokafka's and stop the
    worker where the partition should only start again."""
    failed = faust_private.transaction_failed(producer)
    if failed is not None:
        raise failed


async def check_transactions(settings: Settings) -> None:
    """Exactly-once needs a broker with transactions: refuse at start when it has none
    (Tansu), with a clear word, rather than a worker that cannot commit."""
    producer = clients.producer(
        settings,
        transactional_id=f"{settings.app_id}-eos-check",
        enable_idempotence=True,
    )
    try:
        async with asyncio.timeout(30):
            await producer.start()
    except Exception as exc:
        raise ConfigError(
            "LLM_STREAMS_PROCESSING_GUARANTEE=exactly_once needs a Kafka broker with "
            f"transactions (Apache Kafka); {settings.kafka.broker_url} has none ({exc!r}). "
            "Use at_least_once with this broker (the Tansu demo broker has no transactions)."
        ) from exc
    finally:
        await producer.stop()


__all__ = ["PartitionLost", "Transactions", "check_transactions"]
