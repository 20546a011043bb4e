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
from streams.core.batch.ledger import (
    JOB_PREFIX,
    LEDGER_ITEM_BYTES,
    BatchRecord,
    Ledger,
    batch_key,
    item_key,
    job_key,
)
from streams.core.batch.parking import Parked, Parking, Released, Resume
from streams.core.batch.remote import MaybeCreated, RemoteBatches, answer_of
from streams.core.batch.wire import (
    RESUBMIT,
    Answer,
    BatchOps,
    Resubmit,
    request_line,
)
from streams.core.dispatch import parked
from streams.errors import BadRequest, TaskError, UpstreamError
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

# A batch recorded as being created is taken for never created only this long after:
# its creator may be between the ledger write and the provider's answer.
CREATE_GRACE_S = 120.0


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
        self.max_items = max(1, min(settings.max_items, (ledger_bytes - 1024) // LEDGER_ITEM_BYTES))
        self.metrics = metrics or Metrics()  # none given: one nobody scrapes
        self._pending: dict[int, list[_Waiting]] = {}
        self._durable: dict[tuple[str, int], asyncio.Future[bool]] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._waiters: dict[tuple[str, int], list[asyncio.Future[Answer]]] = {}
        self._followed: dict[str, asyncio.Task[None]] = {}  # local id -> its poller
        self._partition: dict[str, int] = {}  # local id -> its partition, while followed
        self.resume: Resume | None = None  # the edge's, to run parked jobs again
        self._resumes: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        self._resumer: asyncio.Task[None] | None = None
        self._creating: set[str] = set()  # local ids this worker is creating now
        self._tasks: set[asyncio.Task[Any]] = set()
        self._capacity = asyncio.Semaphore(settings.max_pending)
        self._enqueued = 0  # tokens in this worker's unfinished batches
        self._room = asyncio.Condition()
        self.remote = RemoteBatches(ops, settings, self.clock, self._spawn)
        self.files = self.remote.files  # finished batches' files, within a byte budget
        self._settled: OrderedDict[str, None] = OrderedDict()  # batches that handed out
        # Answers go out at a pace: each wakes a task that writes its result.
        self._deliveries: asyncio.Queue[tuple[asyncio.Future[Answer], Answer]] = asyncio.Queue()
        self._pace = AsyncLimiter(max(1.0, settings.intake_per_s / 10), 0.1)
        self._intake = AsyncLimiter(max(1.0, settings.intake_per_s / 10), 0.1)
        self._deliverer: asyncio.Task[None] | None = None

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
            if parking is not None and await self._park(partition, parking, future, durable):
                latest = self._ledger_batch(partition, custom_id, attempt)
                if latest is not None and not self._ended(latest):
                    raise Parked  # its end resumes the job: the job's record is there now
                return None  # it ended meanwhile (its resumes went out before): ask again
            return await future

    def _ended(self, batch: BatchRecord) -> bool:
        return batch.state in ("done", "abandoned") or batch.local_id in self._settled

    async def _park(
        self,
        partition: int,
        parking: Parking,
        answer: asyncio.Future[Answer],
        durable: asyncio.Future[bool] | None,
    ) -> bool:
        """True once the request and the job's record are durably in the ledger; False
        (the job waits for its answer, unacked, as without parking) when the answer came
        first or the ledger cannot take the record."""
        if durable is not None:
            waits: list[asyncio.Future[Any]] = [answer, durable]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if answer.done() or not durable.result():
                return False
        if not self._fits(parking):
            return False
        key = job_key(parking.key)
        try:
            record = parking.packed
            if self.ledger.get(partition, key) != record:
                await self.ledger.put(partition, key, record)
            await self.ledger.durable(partition)
        except Exception as exc:  # the broker away, the partition lost: wait as before
            log.warning("could not park job %s of partition %d: %r", parking.key, partition, exc)
            return False
        self._count_request("parked")
        return True

    def takes(self, parking: Parking | None) -> bool:
        """Whether a job's record may go into a batch: one the edge runs with a `parking`
        whose record the ledger cannot take would wait for its batch unacked — up to its
        24-h window, holding every rebalance of the group that long — so it is answered by
        a call instead (at the full price, counted)."""
        return parking is None or self._fits(parking)  # None: tests, tools wait as they may

    def _fits(self, parking: Parking) -> bool:
        """The ledger topic takes the record."""
        try:
            return len(parking.packed) + 1024 <= self.ledger_bytes
        except Exception:  # a record that cannot be packed cannot be parked
            log.exception("cannot pack the record of %s for the ledger", parking.key)
            return False

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
        p = waiting.partition
        queue = self._pending.setdefault(p, [])
        queue.append(waiting)
        size = sum(len(w.line) for w in queue)
        if len(queue) >= self.max_items or size >= self.settings.max_bytes:
            self._flush(p)
        elif p not in self._timers:
            loop = asyncio.get_running_loop()
            self._timers[p] = loop.call_later(self.settings.linger_s, self._flush, p)

    def _flush(self, partition: int) -> None:
        timer = self._timers.pop(partition, None)
        if timer is not None:
            timer.cancel()
        queue = self._pending.pop(partition, [])
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
            await self.ledger.put(p, batch_key(batch.local_id), batch.dumps())
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
            await self.ledger.put(p, batch_key(batch.local_id), batch.dumps())
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
            await self.ledger.put(batch.partition, batch_key(batch.local_id), batch.dumps())

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
            found = await self.remote.find(batch.local_id, batch.created_at)
            while found is None and time.time() - batch.created_at < CREATE_GRACE_S:
                # Its creator may still be creating it (a worker that lost the partition
                # a moment ago): wait for the provider or the ledger to say more.
                await self.clock.sleep(self.settings.poll_s)
                raw = self.ledger.get(batch.partition, batch_key(batch.local_id))
                latest = BatchRecord.loads(raw) if raw is not None else batch
                if latest.state != "creating":
                    batch = latest
                    break
                found = await self.remote.find(batch.local_id, batch.created_at)
        if batch.state == "creating":
            if found is None:  # never created: its requests go in a new batch
                batch.state = "abandoned"
                await self.ledger.put(batch.partition,
                                     batch_key(batch.local_id), batch.dumps())  # fmt: skip
                self._settle(batch, NO_LINES, RESUBMIT)
                return
            batch.state, batch.remote_id = "submitted", str(found["id"])
            await self.ledger.put(batch.partition, batch_key(batch.local_id),
                                 batch.dumps())  # fmt: skip
        if batch.state == "submitted":
            assert batch.remote_id is not None
            remote = await self.remote.poll(batch.remote_id)
            batch.state, batch.status = "done", str(remote["status"])
            batch.output_file_id = remote.get("output_file_id")
            batch.error_file_id = remote.get("error_file_id")
            if batch.status == "failed":
                errors = (remote.get("errors") or {}).get("data") or [{}]
                batch.error_code = str(errors[0].get("code") or "batch_failed")
                log.warning("batch %s failed: %s", batch.remote_id, errors[0])
            self._count_batch(batch.status)
            await self.ledger.put(batch.partition, batch_key(batch.local_id),
                                 batch.dumps())  # fmt: skip
            if batch.status == "failed":
                self._settle(batch, NO_LINES, self._failure(batch, self._enqueued - (
                    batch.tokens if own else 0)))  # fmt: skip
                return
        await self.remote.with_lines(batch, lambda lines: self._settle(batch, lines, RESUBMIT))

    def _failure(self, batch: BatchRecord, others: int) -> Answer:
        """What a failed batch means for its requests. Over the enqueued-token limit: sent
        again once earlier batches are done (`others`: tokens of this worker's other
        batches) — unless none were running, then the batch alone is too big."""
        code = batch.error_code or "batch_failed"
        if code == "token_limit_exceeded" and others > 0:
            return RESUBMIT
        if code == "token_limit_exceeded":
            return BadRequest(
                f"batch {batch.remote_id} alone is over the provider's enqueued-token "
                "limit: lower LLM_STREAMS_BATCH_API__MAX_ITEMS or set "
                "__MAX_ENQUEUED_TOKENS to the limit",
                code="token_limit_exceeded",
            )
        return UpstreamError(f"batch {batch.remote_id} failed: {code}", code="batch_failed")

    async def _answer_from(self, batch: BatchRecord, custom_id: str) -> Answer:
        """The answer a finished batch of the ledger holds for a request."""
        try:
            if batch.status == "failed":
                answer = self._failure(batch, self._enqueued)
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
                    self._deliveries.put_nowait((future, answer))
                elif not future.done():
                    future.set_result(answer)
        if self._deliverer is None or self._deliverer.done():
            self._deliverer = self._spawn(self._deliver())
        self._resume_jobs(batch)

    # -- parked jobs -----------------------------------------------------------------------

    def _resume_jobs(self, batch: BatchRecord) -> None:
        """The batch ended: the jobs parked on its requests run again (if the partition is
        still this worker's; otherwise its new owner resumes them)."""
        self._settled[batch.local_id] = None  # a job parking from now on asks again
        while len(self._settled) > 10_000:
            self._settled.popitem(last=False)
        p = batch.partition
        if self.resume is None or not self.ledger.owns(p):
            return
        for custom_id in dict.fromkeys(custom_id for custom_id, _ in batch.items):
            if self.ledger.get(p, job_key(custom_id)) is not None:
                self._resumes.put_nowait((p, custom_id))
        self._start_resumer()

    def resume_parked(self, partition: int) -> None:
        """Run every job parked in `partition`'s ledger again (the partition is new to this
        worker): each follows its batches, and so every batch in flight is followed."""
        for key in self.ledger.keys(partition, JOB_PREFIX):
            self._resumes.put_nowait((partition, key[len(JOB_PREFIX) :].decode()))
        self._start_resumer()

    def keep(self, partitions: set[int]) -> None:
        """Only `partitions` are this worker's now: stop following the others' batches
        (their new owners do)."""
        for local_id, p in list(self._partition.items()):
            task = self._followed.get(local_id)
            if p not in partitions and task is not None:
                task.cancel()

    def _start_resumer(self) -> None:
        if not self._resumes.empty() and (self._resumer is None or self._resumer.done()):
            self._resumer = self._spawn(self._resume_paced())

    async def _resume_paced(self) -> None:
        """Parked jobs run again at `intake_per_s`, like the answers they write."""
        while not self._resumes.empty():
            partition, key = self._resumes.get_nowait()
            async with self._pace:
                record = self.ledger.get(partition, job_key(key))
                if record is not None and self.resume is not None and self.ledger.owns(partition):
                    self.resume(partition, key, record)

    async def _deliver(self) -> None:
        """Hand answers to their tasks at `intake_per_s`."""
        while not self._deliveries.empty():
            future, answer = self._deliveries.get_nowait()
            if future.done():
                continue
            async with self._pace:
                if not future.done():
                    future.set_result(answer)

    # -- metrics and shutdown ------------------------------------------------------------

    def _count_batch(self, status: str) -> None:
        self.metrics.batches.labels(status).inc()

    def _count_request(self, outcome: str) -> None:
        self.metrics.batch_requests.labels(outcome).inc()

    async def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


__all__ = ["CREATE_GRACE_S", "BatchLane"]
