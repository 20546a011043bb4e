"""The worker's writes: an outcome, its sink record, the task's state and a review copy, a
forwarded record.

Each goes to the partition of the task it belongs to, through the task store (so the
maps hold what the topics hold) and, with exactly-once, into that partition's
transaction; a sink record goes to its own topic's partition by its key, in the task
partition's transaction. The outcome is written first, its sink record next, the task's
state last: a state saying a record wrote its outcome (`TaskState.wrote`) is then never
ahead of either, even after a kill between them (a run killed after the outcome writes
the sink record again: at-least-once). A write the broker may take later is written
again (only the writes that failed, with backoff); one it refuses for good (too large,
invalid, not authorised) makes the task a `write_refused` dead letter, or is left out
when it is only a copy (the review copy, a dead letter's copy); a worker that cannot
write stops without acking (`CannotWrite`), so the record runs again after the restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, NoReturn

from aiokafka.errors import KafkaError

from streams.core.batch import erased_key, erasure_mark
from streams.core.outcome import Outcome, Prepared
from streams.core.taskstate import TaskState
from streams.errors import WriteRefused
from streams.kafka.limits import Unencodable, WriteLimits, refused_for_good
from streams.kafka.routing import partition_of
from streams.kafka.topics import state_topic
from streams.observability.metrics import Metrics
from streams.observability.tracing import headers_for
from streams.resilience.retry import retry_transient
from streams.settings import Settings
from streams.store.taskstore import Kind, PartitionLost, TaskStore
from streams.worker.eos import Transactions
from streams.worker.shutdown import Watchdog

log = logging.getLogger(__name__)

SEND_ATTEMPTS = 8
Headers = list[tuple[str, bytes]]
# Faust's topic send: (topic, key, value, partition, headers) -> the acked record's offset
TopicSend = Callable[[str, bytes, bytes | None, int, Headers | None], Awaitable[int]]


class CannotWrite(Exception):
    """The broker cannot be written to: the worker is stopping, the record stays unacked."""


class Writer:
    def __init__(
        self,
        settings: Settings,
        *,
        send: TopicSend,
        store: TaskStore,
        eos: Transactions | None,
        limits: WriteLimits,
        metrics: Metrics,
        watchdog: Watchdog,
        crash: Callable[[BaseException], Coroutine[Any, Any, None]],
    ) -> None:
        self.settings = settings
        self._topic_send = send
        self.store = store
        self.eos = eos
        self.limits = limits
        self.metrics = metrics
        self.watchdog = watchdog
        self._crash_app = crash

    async def send(
        self,
        topic: str,
        key: bytes,
        value: bytes | None,
        partition: int,
        headers: Headers | None = None,
        *,
        via: int | None = None,
        plain: bool = False,
    ) -> int:
        """One write to `partition` of `topic`, returned with its offset once the broker
        acked it. `via`: the task partition whose record caused it, when that is another
        (exactly-once: the write goes into that partition's transaction). `plain`: outside
        every transaction (a source record's writes: its partition is no task partition)."""
        if self.eos is not None and not plain:  # into the partition's transaction
            return await self.eos.send(topic, key, value, partition, headers, via=via)
        return await self._topic_send(topic, key, value, partition, headers)

    async def deliver(
        self,
        outcome: Outcome,
        partition: int,
        *,
        prep: Prepared | None = None,
        state: TaskState | Callable[[], TaskState] | None = None,
        written: bool = False,
        plain: bool = False,
    ) -> WriteRefused | None:
        """Write `outcome` to `partition`, then its sink record (and review copy), then the
        task's `state` after it: a state that says the record was answered is never ahead
        of the sink. A result the results topic or its sink refuses for good is not
        written, nor is anything after it: the reason comes back (the caller writes the
        task's dead letter instead). `written`: the outcome is written already (by a run
        killed before the rest), only what follows it is. `plain`: a source record's dead
        letter, no task's — written outside the transactions and the task store. `state`
        may be a function that makes it: called once the outcome is written, so that the
        outcome's write does not wait for it."""
        pending = set() if written else {"outcome"}
        if outcome.sink is not None:
            pending.add("sink")
        if state is not None:
            pending.add("state")
        if outcome.review_value is not None:
            pending.add("review")
        refused: list[WriteRefused] = []

        async def write_pending() -> None:
            made = state if isinstance(state, TaskState) else None
            while pending and not refused:
                if made is None and state is not None and "outcome" not in pending:
                    made = state if isinstance(state, TaskState) else state()
                await self._write_round(outcome, pending, partition, prep, made, refused,
                                        plain)  # fmt: skip

        # Exactly-once: every write of the outcome in one transaction of the partition,
        # however often a round is tried again.
        held = self.eos.held(partition) if self.eos is not None and not plain else None
        async with held or contextlib.nullcontext():
            await self._or_stop(write_pending, f"the {outcome.kind} {outcome.key}")
        return refused[0] if refused else None

    async def _write_round(
        self,
        outcome: Outcome,
        pending: set[str],
        partition: int,
        prep: Prepared | None,
        state: TaskState | None,
        refused: list[WriteRefused],
        plain: bool = False,
    ) -> None:
        """The pending writes due now (the outcome first, then the others together); the
        ones that succeed leave `pending`; raises a failure the broker may mend."""
        if "outcome" in pending:
            names = ["outcome"]
        elif "sink" in pending:  # before the state, with the review copy
            names = sorted(pending & {"sink", "review"})
        else:
            names = sorted(pending)
        # The trace goes on in the outcome's headers (the task's span is current).
        trace = headers_for()
        writes = [self._write(n, outcome, partition, prep, state, trace, plain) for n in names]
        done: list[BaseException | None]
        if len(writes) == 1:  # awaited here: a task of its own costs a thin stream per task
            try:
                await writes[0]
                done = [None]
            except Exception as exc:
                done = [exc]
        else:
            done = await asyncio.gather(*writes, return_exceptions=True)
        transient: BaseException | None = None
        for name, error in zip(names, done, strict=True):
            if error is None:
                pending.discard(name)
            elif not isinstance(error, Exception) or isinstance(error, PartitionLost):
                raise error  # cancelled (unacked), or not this worker's partition
            elif (why := refused_for_good(error)) is None:
                transient = error  # the broker may take it later
            else:
                self._refused(name, outcome, why, error, pending, refused)
        if transient is not None:
            raise transient

    def _refused(
        self,
        name: str,
        outcome: Outcome,
        why: str,
        error: Exception,
        pending: set[str],
        refused: list[WriteRefused],
    ) -> None:
        """A write refused for good: a review copy is left out, a result's refusal is said
        back (its task becomes a write_refused dead letter); anything else means the worker
        cannot write."""
        topic = self._topic_of(name, outcome)
        self._refusal(topic, f"the {name} of {outcome.key}", error)  # counted and logged
        if name == "review" or (name == "sink" and outcome.kind != "result"):
            pending.discard(name)  # a copy (of the result, of a dead letter): left out
        elif name in ("outcome", "sink") and outcome.kind == "result":
            refused.append(WriteRefused(
                f"{topic} refused the task's {'result' if name == 'outcome' else 'sink record'}"
                f" ({why}): {error!r}", code=why
            ))  # fmt: skip
        else:  # a dead letter or a task state the broker will not take: misconfigured
            raise error

    async def _write(
        self,
        name: str,
        outcome: Outcome,
        partition: int,
        prep: Prepared | None,
        state: TaskState | None,
        headers: Headers,
        plain: bool = False,
    ) -> None:
        if name == "outcome":
            kind = Kind.RESULTS if outcome.kind == "result" else Kind.DEAD_LETTERS
            key = outcome.key.encode()
            if plain:
                await self.send(self.store.topics[kind], key, outcome.value, partition, headers,
                                plain=True)  # fmt: skip
            else:
                await self.store.put(kind, partition, key, outcome.value, headers)
        elif name == "state" and state is not None:
            await self.store.put_state(partition, state)
        elif name == "review" and outcome.review_value is not None:
            await self._review(outcome, outcome.review_value, prep, partition, headers)
        elif name == "sink" and (sink := outcome.sink) is not None:
            count = self.limits.partitions.get(sink.topic, self.settings.kafka.partitions)
            frame = self.limits.framing.get(sink.topic)  # the registry's wire format
            try:
                value = frame(sink.value) if frame is not None else sink.value
            except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as exc:
                raise Unencodable(f"{sink.topic}'s registered schema cannot hold the record: "
                                  f"{exc}") from exc  # fmt: skip
            await self.send(sink.topic, sink.key, value, partition_of(sink.key, count),
                            [*headers, *sink.headers], via=partition, plain=plain)  # fmt: skip

    async def _review(
        self,
        outcome: Outcome,
        value: bytes,
        prep: Prepared | None,
        partition: int,
        headers: Headers,
    ) -> None:
        """The result again, on the review topic, with why a person should look at it."""
        topic = self.settings.topics.review
        if len(value) > self.limits.value_bytes(topic):  # the result fits its topic; this copy not
            log.warning("review copy of %s left out: %d bytes, over what %s takes",
                        outcome.key, len(value), topic)  # fmt: skip
            self.metrics.writes_refused.labels(topic, "record_too_large").inc()
            return
        await self.send(topic, outcome.key.encode(), value, partition, headers)
        pipeline = prep.pipeline.name if prep is not None else "?"
        for reason in outcome.review:
            self.metrics.reviews.labels(pipeline, reason).inc()

    async def put_state(self, partition: int, state: TaskState) -> None:
        """A task state alone (one an earlier run missed), as every write: again while the
        broker may take it later, dropped when the partition is not this worker's any
        more (its new owner writes it), the worker stopped when it cannot be written —
        never an error of the task, whose answer is written already."""

        def write() -> Awaitable[None]:
            return self.store.put_state(partition, state)

        await self._or_stop(write, f"the state of {state.task_id}")

    async def erase(
        self,
        task_id: str,
        partition: int,
        result_keys: list[str],
        sinks: list[tuple[str, bytes]],
        session: tuple[bytes, bytes | None] | None = None,
        erased_at: float | None = None,
    ) -> None:
        """Tombstones for what the worker wrote of a task: its results (and their review
        copies) under each of `result_keys`, its dead letter, its records in the sink
        topics (`sinks`: topic and key), its session's turns without its own (`session`:
        the session's key and what is left, None for nothing), then its state — last, so
        that a run killed on the way finds the state and erases again. First, the ledger's
        mark that the task was erased at `erased_at` (the request's time; None: now): a
        record of the task written before it — a parked batch-lane job, a replay sent
        before — does not write its answer back.

        A tombstone a topic refuses for good (this worker may no longer write a sink
        topic) raises `WriteRefused` once the others are written, the state kept: the
        request sent again erases what is left. Stopping instead would stop the worker on
        the same request after every restart."""
        put, send, topics = self.store.put, self.send, self.store.topics
        review = self.settings.topics.review
        mark = erasure_mark(time.time() if erased_at is None else erased_at)
        writes: list[tuple[str, str, Callable[[], Awaitable[object]]]] = [
            (topics[Kind.LEDGER], f"the erasure mark of {task_id}",
             partial(put, Kind.LEDGER, partition, erased_key(task_id), mark)),
        ]  # fmt: skip
        for key in result_keys:
            writes.append((topics[Kind.RESULTS], f"the result {key}",
                           partial(put, Kind.RESULTS, partition, key.encode(), None)))  # fmt: skip
            writes.append((review, f"the review copy of {key}",
                           partial(send, review, key.encode(), None, partition)))  # fmt: skip
        letter = partial(put, Kind.DEAD_LETTERS, partition, task_id.encode(), None)
        writes.append((topics[Kind.DEAD_LETTERS], f"the dead letter of {task_id}", letter))
        for topic, sink_key in sinks:
            count = self.limits.partitions.get(topic, self.settings.kafka.partitions)
            where = partition_of(sink_key, count)
            tombstone = partial(send, topic, sink_key, None, where, via=partition)
            writes.append((topic, f"the {topic} record of {task_id}", tombstone))
        if session is not None:
            turns = partial(put, Kind.SESSIONS, partition, session[0], session[1])
            writes.append((topics[Kind.SESSIONS], f"the turn of {task_id} in its session",
                           turns))  # fmt: skip
        refused: list[WriteRefused] = []
        for topic, what, write in writes:
            try:
                await self._or_stop(write, f"the erasure of {what}", refusals=True)
            except KafkaError as exc:  # refused for good (`refusals`): the rest still go
                refused.append(self._refusal(topic, f"the erasure of {what}", exc))
        if refused:
            raise WriteRefused(
                f"the erasure of {task_id} is not complete (its state is kept: asked again, "
                f"`llm-streams erase` erases what is left): "
                f"{'; '.join(r.message for r in refused)}",
                code=refused[0].code,
            )  # fmt: skip
        await self._or_stop(
            lambda: self.store.put(Kind.TASK_STATES, partition, task_id.encode(), None),
            f"the erasure of the state of {task_id}",
        )

    def _topic_of(self, name: str, outcome: Outcome) -> str:
        t = self.settings.topics
        if name == "state":
            return state_topic(self.settings)
        if name == "review":
            return t.review
        if name == "sink" and outcome.sink is not None:
            return outcome.sink.topic
        return t.results if outcome.kind == "result" else t.dead_letters

    async def forward(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        partition: int,
        headers: Headers,
        *,
        what: str,
        via: int | None = None,
        plain: bool = False,
    ) -> None:
        """A record forwarded to its task's partition (a misrouted record, a source record's
        task or erasure), again while the broker may take it later. Raises `WriteRefused`
        when the broker refuses it for good (too large with its key and headers, invalid):
        the record it came from becomes a dead letter where it stands. Stopping the worker
        instead would stop it again on the same record after every restart."""
        try:
            await self._or_stop(
                lambda: self.send(topic, key, value, partition, headers, via=via, plain=plain),
                what, refusals=True,
            )  # fmt: skip
        except KafkaError as exc:
            raise self._refusal(topic, what, exc) from exc

    def _refusal(self, topic: str, what: str, exc: BaseException) -> WriteRefused:
        """A write `topic` refused for good, counted and logged, as the task's error."""
        why = refused_for_good(exc) or "refused"
        self.metrics.writes_refused.labels(topic, why).inc()
        log.warning("%s refused %s for good: %r", topic, what, exc)
        return WriteRefused(f"{topic} refused {what} ({why}): {exc!r}", code=why)

    async def write_or_stop(self, write: Callable[[], Awaitable[object]], what: str) -> None:
        """One write, again while the broker may take it later; stop when it will not."""
        await self._or_stop(write, what)

    async def _or_stop(
        self, write: Callable[[], Awaitable[object]], what: str, refusals: bool = False
    ) -> None:
        """`write()` again while it fails for a reason the broker may mend (with backoff, at
        most SEND_ATTEMPTS times); dropped when the partition is not this worker's any
        more; otherwise the worker stops without acking (`refusals`: a refusal for good
        is raised to the caller instead)."""

        def transient(exc: BaseException) -> bool:
            return (
                isinstance(exc, KafkaError)
                and not isinstance(exc, PartitionLost)
                and refused_for_good(exc) is None
            )

        try:
            await retry_transient(write, what=f"write of {what}", transient=transient,
                                  attempts=SEND_ATTEMPTS, sleep=asyncio.sleep)  # fmt: skip
        except PartitionLost as exc:  # its new owner answers the record
            log.info("not writing %s: %s", what, exc)
        except KafkaError as exc:
            if refusals and refused_for_good(exc) is not None:
                raise
            await self.stop(f"cannot write {what}", exc)

    async def stop(self, why: str, exc: BaseException | None) -> NoReturn:
        """The broker cannot be written to: stop the worker without acking the record."""
        log.critical("%s: %r; stopping the worker", why, exc)
        error = CannotWrite(why)
        await self.crash(exc or error)
        raise error from exc

    async def crash(self, exc: BaseException) -> None:
        """Stop the worker because of `exc`, within the shutdown grace."""
        self.watchdog.start(f"crash: {exc!r}")
        await self._crash_app(exc)


__all__ = ["SEND_ATTEMPTS", "CannotWrite", "Writer"]
