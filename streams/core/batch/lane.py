"""The batch lane's engine (see `core.batch`): requests gathered per partition into
batches, the ledger written before the provider is asked, each batch followed to its
end, and its answers handed to the requests waiting on them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiolimiter import AsyncLimiter

from streams.core.batch.files import NO_LINES, BatchLines
from streams.core.batch.handout import Handout
from streams.core.batch.ledger import (
    LEDGER_ITEM_BYTES,
    BatchRecord,
    Ledger,
    batch_key,
    item_key,
)
from streams.core.batch.parking import Parked, Parker, Parking, Released, Resume
from streams.core.batch.remote import MaybeCreated, RemoteBatches, failure_of
from streams.core.batch.wire import (
    RESUBMIT,
    Answer,
    BatchOps,
    Resubmit,
    answer_of,
    request_line,
)
from streams.core.dispatch import parked
from streams.core.gathering import Gathering
from streams.errors import TaskError, UpstreamError
from streams.llm.client import (
    LLMRequest,
    LLMResponse,
    completion_budget,
)
from streams.llm.tokens import count_messages
from streams.observability.metrics import Metrics
from streams.resilience.clock import Clock, MonotonicClock
from streams.settings import BatchApiSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Waiting:
    partition: int
    custom_id: str
    attempt: int
    line: bytes
    tokens: int
    # True once the request is durably in the ledger; False if it failed to be.
    durable: asyncio.Future[bool]


class BatchLane:
    """Sends batch-tier requests in batches and hands each its answer."""

    def __init__(
        self,
        ops: BatchOps,
        ledger: Ledger,
        settings: BatchApiSettings,
        metrics: Metrics | None = None,
        *,
        ledger_bytes: int = 1_044_000,
        clock: Clock | None = None,
    ) -> None:
        self.ops = ops
        # Its waits (polls, backoff); its stamps are wall-clock time, as the provider's.
        self.clock = clock or MonotonicClock()
        self.ledger = ledger
        self.settings = settings
        # A batch's ledger record lists its requests and must fit the ledger topic.
        self.ledger_bytes = ledger_bytes
        self.parker = Parker(ledger, ledger_bytes, lambda: self._count_request("parked"))
        self.max_items = max(1, min(settings.max_items, (ledger_bytes - 1024) // LEDGER_ITEM_BYTES))
        self.metrics = metrics or Metrics()  # none given: one nobody scrapes
        self._gathering: Gathering[int, _Waiting] = Gathering(self._gathered)
        self._durable: dict[tuple[str, int], asyncio.Future[bool]] = {}
        self._waiters: dict[tuple[str, int], list[asyncio.Future[Answer]]] = {}
        self._followed: dict[str, asyncio.Task[None]] = {}  # local id -> its poller
        self._partition: dict[str, int] = {}  # local id -> its partition, while followed
        self._creating: set[str] = set()  # local ids this worker is creating now
        self._tasks: set[asyncio.Task[Any]] = set()
        self._capacity = asyncio.Semaphore(settings.max_pending)
        self._enqueued = 0  # tokens in this worker's unfinished batches
        self._room = asyncio.Condition()
        self.remote = RemoteBatches(ops, settings, self.clock, self._spawn)
        self.files = self.remote.files  # finished batches' files, within a byte budget
        self._settled: OrderedDict[str, None] = OrderedDict()  # batches that handed out
        # Answers and resumed jobs go out at a pace: each wakes a task that writes.
        self.handout = Handout(ledger, settings.intake_per_s, self._spawn)
        self._intake = AsyncLimiter(max(1.0, settings.intake_per_s / 10), 0.1)

    @property
    def resume(self) -> Resume | None:
        """The edge's, to run parked jobs again."""
        return self.handout.resume

    @resume.setter
    def resume(self, resume: Resume | None) -> None:
        self.handout.resume = resume

    # -- the job's side ----------------------------------------------------------------

    async def complete(
        self,
        partition: int,
        custom_id: str,
        attempt: int,
        request: LLMRequest,
        parking: Parking | None = None,
    ) -> LLMResponse:
        """The answer to one attempt, through a batch. Raises the attempt's TaskError, or
        `Parked` when the job has a `parking` (the edge's record) and the request waits in
        a batch; without one (tests, tools) the job waits for its batch."""
        async with self._capacity:
            key = (custom_id, attempt)
            gave_none: set[str] = set()  # batches that had it and gave no answer
            while True:
                future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
                self._waiters.setdefault(key, []).append(future)
                try:
                    answer = await self._ask(partition, key, request, gave_none, future, parking)
                    if answer is None:
                        continue
                finally:
                    waiting = self._waiters.get(key, [])
                    if future in waiting:
                        waiting.remove(future)
                    if not waiting:
                        self._waiters.pop(key, None)
                if isinstance(answer, Resubmit):
                    self._count_request("resubmitted")
                    if answer.batch is not None:
                        gave_none.add(answer.batch)
                    continue
                if isinstance(answer, Released):
                    raise Released  # one of its own for each job
                if isinstance(answer, TaskError):
                    raise answer
                return answer

    async def _ask(
        self,
        partition: int,
        key: tuple[str, int],
        request: LLMRequest,
        gave_none: set[str],
        future: asyncio.Future[Answer],
        parking: Parking | None,
    ) -> Answer | None:
        """One try at an answer: from a finished batch of the ledger, by following the
        batch the ledger has the request in, or in a new batch. None: try again."""
        custom_id, attempt = key
        if not self.ledger.owns(partition):
            raise Released
        known = self._ledger_batch(partition, custom_id, attempt)
        if known is not None and known.local_id in gave_none:
            known = None
        if known is not None and known.state == "done":
            return await self._answer_from(known, custom_id)
        durable: asyncio.Future[bool] | None = None
        if known is not None and known.state != "abandoned":
            self._follow(known)
        elif key not in self._durable:  # not queued here yet
            durable = self._durable[key] = asyncio.get_running_loop().create_future()
            async with self._intake:  # at a pace (the job holds its slot)
                pass
            line = request_line(custom_id, request)
            tokens = self._prompt_tokens(request) + completion_budget(request.params)
            self._enqueue(_Waiting(partition, custom_id, attempt, line, tokens, durable))
        else:  # queued by another run of the same request: parks once that is in the ledger
            durable = self._durable[key]
        async with parked():
            if parking is not None and await self.parker.park(partition, parking, future, durable):
                latest = self._ledger_batch(partition, custom_id, attempt)
                if latest is not None and not self._ended(latest):
                    raise Parked  # its end resumes the job: the job's record is there now
                return None  # it ended meanwhile (its resumes went out before): ask again
            return await future

    def _latest(self, batch: BatchRecord) -> BatchRecord:
        """The ledger's latest of `batch`."""
        raw = self.ledger.get(batch.partition, batch_key(batch.local_id))
        return BatchRecord.loads(raw) if raw is not None else batch

    async def _record(self, batch: BatchRecord) -> None:
        await self.ledger.put(batch.partition, batch_key(batch.local_id), batch.dumps())

    def _ended(self, batch: BatchRecord) -> bool:
        return batch.state in ("done", "abandoned") or batch.local_id in self._settled

    def takes(self, parking: Parking | None) -> bool:
        """Whether a job's record may go into a batch (see `Parker.takes`)."""
        return self.parker.takes(parking)

    def _prompt_tokens(self, request: LLMRequest) -> int:
        """Counted for an enqueued-token limit; otherwise bytes / 4 will do."""
        if self.settings.max_enqueued_tokens:
            return count_messages(request.messages)
        return sum(len(m["content"].encode()) for m in request.messages) // 4

    def _ledger_batch(self, partition: int, custom_id: str, attempt: int) -> BatchRecord | None:
        raw = self.ledger.get(partition, item_key(custom_id, attempt))
        if raw is None:
            return None
        local_id = orjson.loads(raw)["batch"]
        found = self.ledger.get(partition, batch_key(local_id))
        return BatchRecord.loads(found) if found is not None else None

    # -- gathering and sending ---------------------------------------------------------

    def _enqueue(self, waiting: _Waiting) -> None:
        def full(queue: list[_Waiting]) -> bool:
            return (len(queue) >= self.max_items
                    or sum(len(w.line) for w in queue) >= self.settings.max_bytes)  # fmt: skip

        self._gathering.add(waiting.partition, waiting, full, self.settings.linger_s)

    def _gathered(self, partition: int, queue: list[_Waiting]) -> None:
        """The partition's gathered requests, in batches within the item and byte limits."""
        while queue:
            take: list[_Waiting] = []
            size = 0
            for w in queue:
                if take and (len(take) >= self.max_items
                             or size + len(w.line) > self.settings.max_bytes):  # fmt: skip
                    break
                take.append(w)
                size += len(w.line)
            queue = queue[len(take) :]
            batch = BatchRecord(
                local_id=uuid.uuid4().hex, partition=partition,
                items=[[w.custom_id, w.attempt] for w in take],
                tokens=sum(w.tokens for w in take), created_at=time.time(), lines=take,
            )  # fmt: skip
            self._spawn(self._submit(batch))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _submit(self, batch: BatchRecord) -> None:
        limit = self.settings.max_enqueued_tokens
        async with self._room:  # within the provider's enqueued-token limit
            await self._room.wait_for(
                lambda: not limit or self._enqueued == 0 or self._enqueued + batch.tokens <= limit
            )
            self._enqueued += batch.tokens
        self._creating.add(batch.local_id)
        p = batch.partition
        try:
            # The ledger first: a worker that dies from here on finds the batch by its id.
            await self._record(batch)
            await asyncio.gather(*(
                self.ledger.put(p, item_key(w.custom_id, w.attempt),
                               orjson.dumps({"batch": batch.local_id}))
                for w in batch.lines
            ))  # fmt: skip
            # Created only once the ledger cannot lose it: a crash before sends nothing.
            await self.ledger.durable(p)
            if not self.ledger.owns(p):  # lost meanwhile: its new owner sends the requests
                raise Released
            self._durably_in(batch, True)
            remote = await self.remote.create(batch)
        except MaybeCreated as exc:
            # The provider may have made it and its answer was lost: followed as a batch
            # whose creator died — found by its metadata, or abandoned after the grace and
            # its requests sent anew — never created a second time meanwhile.
            log.warning("batch %s: not known whether it was created (%r); following it",
                        batch.local_id, exc.__cause__)  # fmt: skip
            self._creating.discard(batch.local_id)
            self._follow(batch, own=True)
            return
        except (Exception, Released) as exc:  # not created: its requests' tasks try again
            self._not_submitted(batch, exc)
            return
        batch.state, batch.remote_id = "submitted", str(remote["id"])
        self._creating.discard(batch.local_id)
        self._count_batch("submitted")
        log.info("batch %s (%s): %d requests of partition %d submitted", batch.local_id,
                 batch.remote_id, len(batch.items), p)  # fmt: skip
        try:  # a ledger that misses it finds it by its metadata, as after a crash
            await self._record(batch)
        except Exception as exc:
            log.warning("batch %s: its submission not in the ledger (%r); it is followed "
                        "all the same", batch.local_id, exc)  # fmt: skip
        self._follow(batch, own=True)

    def _not_submitted(self, batch: BatchRecord, exc: BaseException) -> None:
        """The batch was not created: the ledger says so (a re-run sends its requests in
        a new batch), and its waiting requests get the error."""
        self._durably_in(batch, False)
        self._release(batch)
        error: Answer = (
            exc
            if isinstance(exc, TaskError | Released)
            else UpstreamError(f"batch not submitted: {exc!r}", code="batch_not_submitted")
        )
        log.warning("batch %s not submitted: %r", batch.local_id, exc)
        batch.state, batch.status = "done", "not_submitted"
        self._spawn(self._record_not_submitted(batch))
        self._creating.discard(batch.local_id)
        self._settle(batch, NO_LINES, error)

    async def _record_not_submitted(self, batch: BatchRecord) -> None:
        with contextlib.suppress(Exception):
            await self._record(batch)

    def _durably_in(self, batch: BatchRecord, durable: bool) -> None:
        """The batch's requests are (or failed to be) durably in the ledger: no longer
        queued here; jobs waiting to park hear of it."""
        for w in batch.lines:
            key = (w.custom_id, w.attempt)
            if self._durable.get(key) is w.durable:
                self._durable.pop(key, None)
            if not w.durable.done():
                w.durable.set_result(durable)

    def _release(self, batch: BatchRecord) -> None:
        """The batch's tokens are no longer enqueued. Synchronous, so that a watcher
        ends in the same step that hands out its batch's answers (a run that comes
        later then starts its own watcher instead of waiting on a finished one)."""
        if batch.released:
            return
        batch.released = True
        self._enqueued = max(0, self._enqueued - batch.tokens)
        self._spawn(self._notify_room())

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    # -- following a batch to its end ----------------------------------------------------

    def _follow(self, batch: BatchRecord, *, own: bool = False) -> None:
        if not own and batch.local_id in self._creating:
            return  # this worker is creating it: its own watcher starts once it exists
        running = self._followed.get(batch.local_id)
        if running is not None and not running.done():
            return
        self._settled.pop(batch.local_id, None)  # followed again: it has not ended
        task = self._spawn(self._watch(batch, own))
        self._followed[batch.local_id] = task
        self._partition[batch.local_id] = batch.partition

        def unfollowed(_: object) -> None:
            if self._followed.get(batch.local_id) is task:
                del self._followed[batch.local_id]
                self._partition.pop(batch.local_id, None)

        task.add_done_callback(unfollowed)

    async def _watch(self, batch: BatchRecord, own: bool) -> None:
        try:
            await self._watch_once(batch, own)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave a job waiting on a batch forever
            log.exception("following batch %s failed", batch.local_id)
            # Not at once: a parked job resumed now would follow the batch again at once.
            await self.clock.sleep(self.settings.poll_max_s)
            self._settle(
                batch, NO_LINES, UpstreamError(f"batch lane: {exc!r}", code="batch_lane_error")
            )
        finally:
            if own:
                self._release(batch)

    async def _watch_once(self, batch: BatchRecord, own: bool) -> None:
        if batch.state == "creating":
            batch, found = await self.remote.found(batch, self._latest)
            if batch.state == "creating" and found is None:  # never created: sent anew
                batch.state = "abandoned"
                await self._record(batch)
                self._settle(batch, NO_LINES, RESUBMIT)
                return
            if found is not None:
                batch.state, batch.remote_id = "submitted", str(found["id"])
                await self._record(batch)
        if batch.state == "submitted":
            await self.remote.ended(batch)
            self._count_batch(batch.status or "")
            await self._record(batch)
            if batch.status == "failed":
                others = self._enqueued - (batch.tokens if own else 0)
                self._settle(batch, NO_LINES, failure_of(batch, others))
                return
        await self.remote.with_lines(batch, lambda lines: self._settle(batch, lines, RESUBMIT))

    async def _answer_from(self, batch: BatchRecord, custom_id: str) -> Answer:
        """The answer a finished batch of the ledger holds for a request."""
        try:
            if batch.status == "failed":
                answer = failure_of(batch, self._enqueued)
            elif batch.status == "not_submitted":
                answer = UpstreamError(f"batch {batch.local_id} was not submitted",
                                       code="batch_not_submitted")  # fmt: skip
            else:
                line = await self.remote.with_lines(batch, lambda lines: lines.get(custom_id))
                answer = RESUBMIT if line is None else self._answer_of(line, count=False)
        except TaskError as exc:
            return exc
        except Exception as exc:  # its files unreadable
            return UpstreamError(f"batch lane: {exc!r}", code="batch_lane_error")
        return Resubmit(batch.local_id) if isinstance(answer, Resubmit) else answer

    def _answer_of(self, line: dict[str, Any], *, count: bool) -> Answer:
        """A batch line as the attempt's answer, counted when `count`."""
        answer = answer_of(line)
        if count and isinstance(answer, LLMResponse | TaskError):
            self._count_request("ok" if isinstance(answer, LLMResponse) else "error")
        return answer

    def _settle(self, batch: BatchRecord, lines: BatchLines, missing: Answer) -> None:
        """Hand every waiting request of the batch its answer."""
        for custom_id, attempt in batch.items:
            futures = self._waiters.get((custom_id, attempt), [])
            line = lines.get(custom_id)
            answer = missing if line is None else self._answer_of(line, count=True)
            if isinstance(answer, Resubmit):  # say which batch had nothing for it
                answer = Resubmit(batch.local_id)
            for future in futures:
                if isinstance(answer, LLMResponse):
                    self.handout.answer(future, answer)
                elif not future.done():
                    future.set_result(answer)
        self._resume_jobs(batch)

    # -- parked jobs -----------------------------------------------------------------------

    def _resume_jobs(self, batch: BatchRecord) -> None:
        """The batch ended: the jobs parked on its requests run again (if the partition is
        still this worker's; otherwise its new owner resumes them)."""
        self._settled[batch.local_id] = None  # a job parking from now on asks again
        while len(self._settled) > 10_000:
            self._settled.popitem(last=False)
        self.handout.resume_jobs(batch.partition, (custom_id for custom_id, _ in batch.items))

    def resume_parked(self, partition: int) -> None:
        """Run every job parked in `partition`'s ledger again (the partition is new to this
        worker): each follows its batches, and so every batch in flight is followed."""
        self.handout.resume_partition(partition)

    def keep(self, partitions: set[int]) -> None:
        """Only `partitions` are this worker's now: stop following the others' batches
        (their new owners do)."""
        for local_id, p in list(self._partition.items()):
            task = self._followed.get(local_id)
            if p not in partitions and task is not None:
                task.cancel()

    # -- metrics and shutdown ------------------------------------------------------------

    def _count_batch(self, status: str) -> None:
        self.metrics.batches.labels(status).inc()

    def _count_request(self, outcome: str) -> None:
        self.metrics.batch_requests.labels(outcome).inc()

    async def close(self) -> None:
        self._gathering.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


__all__ = ["BatchLane"]
