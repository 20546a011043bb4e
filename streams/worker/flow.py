"""A record's way through the worker, top to bottom, in one place.

The agent runs it (`RecordFlow.run`: the record's span, its metrics and drift once it
ended, a bug as one `internal_error` dead letter) for each record it takes, and the
parked-record resumer for each record it runs again; acking, in arrival order per
partition, stays the agent's:

1. **headers**: how the record asks to be answered (`asked`: forced, a tier, a
   backtrack's note), where it first stood (`original_offset`, for a replay) and which
   command run sent it (`sent_by`: a second copy of it ends nothing again);
2. **route**: a record on another partition than its task's home (its session's, or
   its task id's) is forwarded there and ends here — read from the record without
   preparing its prompt, which its home does;
3. **prepare** (`core.processor`): decode, validate, version, render, the session's
   earlier turns; bad input is a dead letter (once);
4. **decide** (`core.decide`): written already by this record, a stored answer, an
   identical input's answer, or the LLM;
5. **deliver** (`worker.writer`): the outcome, then the task state and a review copy;
6. **turn**: a session task's answer joins its session, after its result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from streams.contract.headers import (
    BACKTRACK_HEADER,
    ERASE_HEADER,
    FORCE_HEADER,
    REPLAY_ID_HEADER,
    REPLAY_OF_HEADER,
    REROUTED_FROM_HEADER,
    SOURCE_OF_HEADER,
    TIER_HEADER,
    header_items,
)
from streams.contract.lanes import Lane, Tier
from streams.contract.records import EraseRequest, Source, json_object
from streams.core.batch import Parked, erased_key, erased_since
from streams.core.budget import Withdrawn
from streams.core.decide import Asked, Decider, Decision, Ended
from streams.core.drift import DriftMonitor
from streams.core.outcome import Outcome, Prepared
from streams.core.processor import TaskProcessor
from streams.core.sessions import has_turn, without_turn
from streams.core.sinks import erased
from streams.core.taskstate import run_key
from streams.errors import InternalError, InvalidInput, NotOurs, WriteRefused
from streams.kafka.routing import partition_for, partition_of, task_key
from streams.observability.logs import current_task_id
from streams.observability.metrics import Metrics
from streams.store.taskstore import Kind, PartitionLost, TaskStore
from streams.worker.observe import record_ended, record_span
from streams.worker.parked import StoredRecord
from streams.worker.writer import CannotWrite, Writer

log = logging.getLogger(__name__)

BACKTRACK_NOTES = {b"restore": "backtrack: restored", b"rerun": "backtrack: re-run"}
TIERS = {tier.value.encode(): tier for tier in Tier}


def header(message: Any, name: str) -> bytes | None:
    """A record header's value (the last one of that name), or None."""
    found = None
    for key, value in header_items(message.headers):
        if key == name:
            found = value
    return found


def asked(message: Any) -> Asked:
    """How a record asks to be answered, from its headers."""
    backtrack = header(message, BACKTRACK_HEADER)
    return Asked(
        force=header(message, FORCE_HEADER) == b"1" or backtrack == b"rerun",
        tier=TIERS.get(header(message, TIER_HEADER) or b""),
        note=BACKTRACK_NOTES.get(backtrack or b""),
    )


def sent_by(message: Any) -> str | None:
    """The command run that sent a record and the record it copied (its
    `llm-streams-replay-id` and `llm-streams-replay-of` headers) as its task's history
    keeps them (`run_key`), or None."""
    run, copied = header(message, REPLAY_ID_HEADER), header(message, REPLAY_OF_HEADER)
    if not run or not copied:
        return None
    return run_key(run, copied)


def original_offset(message: Any) -> int:
    """Where a record stands in its partition: a replayed record, where it was first
    (its `llm-streams-replay-of` header); otherwise its own offset."""
    origin = header(message, REPLAY_OF_HEADER)
    if origin:
        try:
            return int(origin.rsplit(b"/", 1)[1])
        except (IndexError, ValueError):
            pass
    return int(message.offset)


class RecordFlow:
    """The steps of one record (see the module's text), over the worker's processor, its
    decider, its task store and its writer."""

    def __init__(
        self,
        processor: TaskProcessor,
        decider: Decider,
        store: TaskStore,
        writer: Writer,
        *,
        partitions: int,
        sessions_bytes: int,
        lane_of: Callable[[str], Lane],
        metrics: Metrics,
        drift: DriftMonitor | None = None,
    ) -> None:
        self.processor = processor
        self.decider = decider
        self.store = store
        self.writer = writer
        self.partitions = partitions  # of the task topics: a task's home is one of them
        self.sessions_bytes = sessions_bytes  # bytes a session's turns may take
        self.lane_of = lane_of
        self.metrics = metrics
        self.drift = drift  # fed every fresh answer (output drift per version)

    async def run(self, message: Any, taken_at: float) -> Ended:
        """One record (a Faust message, or a `StoredRecord` run again) answered and its
        outcome written, in its span; what it ended as. Raises `CannotWrite` (and
        cancellation): the record stays unacked and runs again after the restart."""
        m = self.metrics
        # Log lines written for this record carry its task id (the key).
        current_task_id.set(message.key.decode(errors="replace") if message.key else None)
        source = Source(topic=message.topic, partition=message.partition, offset=message.offset)
        lane_name = self.lane_of(message.topic).name.lower()
        with record_span(message, lane_name) as span:
            m.queue_wait.labels(lane_name).observe(time.monotonic() - taken_at)
            m.in_flight.inc()
            try:
                if message.partition < self.partitions:  # past them: no task's home
                    await self.store.ready(message.partition)  # its answers loaded
            except PartitionLost as exc:  # given away: its owner runs it (again)
                log.info("record %s/%d/%d not run: %s", source.topic, source.partition,
                         source.offset, exc)  # fmt: skip
                m.in_flight.dec()
                return Ended.RELEASED
            try:
                kind, outcome = await self.handle(message, source, span)
            except (CannotWrite, asyncio.CancelledError):
                raise
            except (Parked, Withdrawn, NotOurs) as exc:
                # Parked: durably in the batch lane's ledger, which resumes it. Withdrawn:
                # it waited at a spend cap and its partition was given away to its owner.
                # PartitionLost: the partition's store was dropped on the record's way (its
                # local copy found damaged): it runs again when the partition starts again.
                kind = Ended.PARKED if isinstance(exc, Parked) else Ended.RELEASED
                span.set_attribute("llm_streams.outcome", kind)
                return kind
            except Exception as exc:  # a bug: the record still ends as one dead letter
                log.exception("internal error on %s/%d/%d", source.topic, source.partition,
                              source.offset)  # fmt: skip
                kind, outcome = await self._internal_error(message, source, exc)
            finally:
                m.in_flight.dec()
            record_ended(m, self.drift, span, lane=lane_name, kind=kind, outcome=outcome,
                         source=source, timestamp=message.timestamp)  # fmt: skip
            return kind

    async def _internal_error(
        self, message: Any, source: Source, exc: Exception
    ) -> tuple[Ended, Outcome | None]:
        """A bug met this record: it ends as a dead letter `internal_error` (not retried,
        not redriven as a provider fault), written once."""
        error = InternalError(f"internal error: {exc!r}", code="internal_error")
        outcome = self.processor.dead_letter(error, message.value, message.key, source)
        return await self.dead_here(outcome, source)

    async def handle(self, message: Any, source: Source, span: Any) -> tuple[Ended, Outcome | None]:
        """Answer one record and write its outcome: what it ended as (result, dead_letter,
        already_done: an earlier run wrote it, rerouted: forwarded to its task's partition)
        and the outcome written (None when nothing was)."""
        processor, decider = self.processor, self.decider
        if source.partition >= self.partitions:  # added to the topic later: no task's home
            return await self._away(message, source)
        via = header(message, ERASE_HEADER)
        if via is not None:  # not a task: the request to erase one
            return await self._erase(message, source, via.decode(errors="replace"))
        # 2. route: its home, read from the record as it is (its prompt is its home's work)
        routed = await self._route(message, source)
        if routed is not None:
            return routed
        # 3. prepare
        prep = processor.intake.prepare(
            message.value, message.key, source,
            history=lambda session: self.store.get(Kind.SESSIONS, source.partition,
                                                   session.encode()),
            position=original_offset(message),
        )  # fmt: skip
        # A record of a task erased since it was written: not answered, nor dead-lettered
        # (a new dead letter would carry the erased record again).
        task_id = prep.task_id if isinstance(prep, Outcome) else prep.task.task_id
        if task_id is not None and self._erased_since(task_id, source.partition,
                                                      message.timestamp):  # fmt: skip
            return Ended.ERASED, None
        if isinstance(prep, Outcome):  # bad input: a dead letter, unless written
            return await self.dead_here(prep, source)
        lane = self.lane_of(message.topic)
        if message.key not in (prep.task.task_id.encode(), (prep.session or "").encode()):
            # On its task's partition after all: answered here, where its answers live.
            self.metrics.misrouted.labels(lane.name.lower(), "answered").inc()
        span.set_attributes({
            "llm_streams.pipeline": prep.pipeline.name,
            "llm_streams.prompt_version": prep.version.version,
            "llm_streams.result_key": prep.result_key,
        })  # fmt: skip
        # 1. its headers; a batch-tier request parks the job once it waits in a batch
        how = asked(message)
        prep = self._as_run(prep, message, lane)
        # 4. decide
        decision = await decider.decide(prep, lane, how)
        if decision.outcome is None:  # an earlier run wrote it: what it may have left
            await self._finish_earlier(decision, prep, how.note)
            return decision.kind, None
        # 5. deliver
        written = await self._deliver(decision.outcome, prep, how.note)
        # 6. the session's turn, after its result
        if written.output is not None:
            await self._add_turn(source.partition, prep, written.output)
        return Ended.of(written), written

    def _erased_since(self, task_id: str, partition: int, timestamp: float | None) -> bool:
        """Whether the task was erased after this record of it was written: a record read
        again (a replay sent before the erasure, a batch-lane job parked when it came, a
        group read from the start) would write back what the erasure took away. The
        erasure's mark is in the partition's ledger (`core.batch.ledger.erased_since`)."""
        mark = self.store.get(Kind.LEDGER, partition, erased_key(task_id))
        if not erased_since(mark, timestamp):
            return False
        log.info("a record of task %s written before its erasure is not answered", task_id)
        return True

    async def _route(self, message: Any, source: Source) -> tuple[Ended, Outcome | None] | None:
        """A record away from its task's home (keyed otherwise by its producer) forwarded
        there — or, bad input, its dead letter where it stands; None: it is at home."""
        route = self.processor.intake.route_of(message.value)
        if route is None:
            return None
        task_id, routed_by = route
        home = partition_for(routed_by, self.partitions)
        if home == message.partition:
            return None
        refused = self.processor.intake.refusal(message.value, message.key, source)
        if refused is not None:
            return await self.dead_here(refused, source)
        try:
            await self._reroute(message, source, home, task_id.encode())
        except WriteRefused as exc:  # with its new key and header, over what the topic takes
            return await self.dead_here(
                self.processor.dead_letter(exc, message.value, message.key, source), source
            )
        return Ended.REROUTED, None

    def _as_run(self, prep: Prepared, message: Any, lane: Lane) -> Prepared:
        """The task as this record runs it: in the replay lane with its record, for a
        batch-tier job to park with; forwarded from a source record, with that record."""
        if lane is Lane.REPLAY and self.processor.batches is not None:
            prep = replace(prep, record=StoredRecord.of(message).pack)
        if (origin := header(message, SOURCE_OF_HEADER)) is not None:
            prep = replace(prep, origin=origin.decode(errors="replace"))
        if (run := sent_by(message)) is not None:
            prep = replace(prep, run=run)
        return prep

    async def _finish_earlier(self, decision: Decision, prep: Prepared, note: str | None) -> None:
        """What a run killed after writing the outcome left undone: its sink record and
        the task's state, or the state alone; the session's turn."""
        partition = prep.source.partition
        if decision.written is not None and decision.written.sink is not None:
            await self._deliver(decision.written, prep, note, written=True)
        elif decision.state is not None:
            await self.writer.put_state(partition, decision.state)
        await self._add_turn(partition, prep, None)

    async def _deliver(
        self, outcome: Outcome, prep: Prepared, note: str | None, written: bool = False
    ) -> Outcome:
        """The outcome, its sink record, then the task's state after it (`written`: the
        outcome is written already); a result its topic or its sink refuses for good makes
        the task's dead letter, written instead. What was written."""
        partition = prep.source.partition
        # The state is made once the outcome is written: off the way of the answer.
        refusal = await self.writer.deliver(
            outcome, partition, prep=prep,
            state=lambda: self.decider.state_after(outcome, prep, note), written=written,
        )  # fmt: skip
        if refusal is None:
            return outcome
        letter = self.processor.failed(prep, refusal, outcome)
        await self.writer.deliver(
            letter, partition, prep=prep, state=lambda: self.decider.state_after(letter, prep, note)
        )
        return letter

    async def _add_turn(
        self, partition: int, prep: Prepared, output: dict[str, Any] | None
    ) -> None:
        """A session task's answered turn into its session, written after its result. No
        `output`: the task was answered before; its turn is added from its stored result
        if a run was killed between the two."""
        if prep.session is None or prep.version.spec.session is None:
            return
        key = str(prep.session).encode()
        stored = self.store.get(Kind.SESSIONS, partition, key)
        if output is None:
            earlier = json_object(self.store.result(partition, prep.result_key))
            if has_turn(stored, prep.task.task_id) or earlier is None:
                return
            output = earlier.get("output")
            if not isinstance(output, dict):
                return
        value = prep.session_turns(stored, output, self.sessions_bytes)
        if value is None:
            return

        def write() -> Awaitable[None]:
            return self.store.put(Kind.SESSIONS, partition, key, value)

        await self.writer.write_or_stop(write, what=f"session {prep.session}'s turn")

    async def dead_here(self, letter: Outcome, source: Source) -> tuple[Ended, Outcome | None]:
        """A bad record's dead letter, written on its own partition unless an earlier run
        of this very record wrote it. A record on a partition added to the task topic
        later (no dead-letter partition, no store there): on its key's home among the
        first `partitions`, outside the store (none is there to say it was written)."""
        if source.partition >= self.partitions:
            home = partition_of(letter.key.encode(), self.partitions)
            await self.writer.deliver(letter, home, plain=True)
            return Ended.of(letter), letter
        if self.decider.dead_letter_written(letter.key, source):
            return Ended.ALREADY_DONE, None
        await self.writer.deliver(letter, source.partition)
        return Ended.of(letter), letter

    async def _erase(self, message: Any, source: Source, via: str) -> tuple[Ended, Outcome | None]:
        """Erase a task on its partition — its session's, for a task of a session —
        (forwarded there when it is not this one): its results under every result key its
        state knows, their review copies, its dead letter, its records in its pipeline's
        sink, its turn in its session, then its state. Counted."""
        try:
            request = EraseRequest.model_validate_json(message.value or b"")
        except ValueError as exc:
            bad = InvalidInput(f"erase request is not one: {exc}", code="bad_erase_request")
            return await self.dead_here(
                self.processor.dead_letter(bad, message.value, message.key, source), source
            )
        home = partition_of(task_key(request.task_id, request.session_id), self.partitions)
        if home != source.partition:
            await self._reroute(message, source, home, request.task_id.encode())
            return Ended.REROUTED, None
        state = self.store.state(home, request.task_id)
        keys = [] if state is None else sorted(
            {k for k in [state.result_key, *(h.result_key for h in state.history)] if k}
        )  # fmt: skip
        spec = self.processor.registry.sink_of(request.pipeline)
        sinks = [] if spec is None else erased(
            spec, request.task_id, request.source_key, keys, request.source_key_base64
        )  # fmt: skip
        turns = None
        if request.session_id is not None:  # the session without the task's turn
            key = request.session_id.encode()
            stored = self.store.get(Kind.SESSIONS, home, key)
            if (left := without_turn(stored, request.task_id)) is not stored:
                turns = (key, left)
        try:
            await self.writer.erase(request.task_id, home, keys, sinks, turns,
                                    erased_at=message.timestamp)  # fmt: skip
        except WriteRefused as exc:  # the rest erased, the state kept: its own dead letter
            refused: WriteRefused | None = exc
        else:
            refused = None
        if state is not None and state.input_hash:  # nor handed to an identical input
            self.decider.cache.forget(state.input_hash)
        if refused is not None:
            log.warning("task %s of %s: %s", request.task_id, request.pipeline, refused.message)
            letter = self.processor.dead_letter(refused, message.value, message.key, source)
            return await self.dead_here(letter, source)
        # A pipeline this worker knows, or one label for the rest: the name is the
        # request's, and a label per name any record brings would grow without bound.
        known = request.pipeline in self.processor.registry.pipelines
        self.metrics.erasures.labels(request.pipeline if known else "unknown", via).inc()
        log.info("task %s of %s erased (asked by %s): %d result(s), its state, dead letter "
                 "and sink records", request.task_id, request.pipeline, via, len(keys))  # fmt: skip
        return Ended.ERASED, None

    async def _away(self, message: Any, source: Source) -> tuple[Ended, Outcome | None]:
        """A record on a partition past the task topics' first `partitions` (added to the
        topic after the task store's topics were made: no task's home, no partition of
        the store's topics) forwarded to its task's home — an erasure without a task id by
        its key — and answered there. Bad input, or a task the topic refuses with its new
        key and header, is a dead letter at its home (`dead_here`)."""
        intake = self.processor.intake
        route = intake.route_of(message.value)
        key = route[0].encode() if route is not None else (message.key or b"")
        home = (partition_for(route[1], self.partitions) if route is not None
                else partition_of(key, self.partitions))  # fmt: skip
        erasure = header(message, ERASE_HEADER) is not None  # no task: its home reads it
        letter = None if erasure else intake.refusal(message.value, message.key, source)
        if letter is None:
            try:
                await self._reroute(message, source, home, key)
                return Ended.REROUTED, None
            except WriteRefused as exc:
                letter = self.processor.dead_letter(exc, message.value, message.key, source)
        return await self.dead_here(letter, source)

    async def _reroute(self, message: Any, source: Source, home: int, key: bytes) -> None:
        """Forward a record to the partition its task (or its session) maps to, keyed by
        its task id; it is answered there. Counted, and the original position goes in a
        header."""
        headers = [(k, v) for k, v in (message.headers or ()) if k != REROUTED_FROM_HEADER]
        origin = f"{source.topic}/{source.partition}/{source.offset}".encode()
        headers.append((REROUTED_FROM_HEADER, origin))
        log.info("record %s/%d/%d of task %r belongs to partition %d: forwarded there",
                 source.topic, source.partition, source.offset,
                 key.decode(errors="replace"), home)  # fmt: skip

        await self.writer.forward(message.topic, key, message.value, home,
                                  headers, what=f"the forward of {origin.decode()}",
                                  via=source.partition)  # fmt: skip
        self.metrics.misrouted.labels(self.lane_of(message.topic).name.lower(),
                                      "rerouted").inc()  # fmt: skip


__all__ = ["RecordFlow", "asked", "header", "original_offset", "sent_by"]
