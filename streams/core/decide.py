"""What one valid record needs, given what the task store already holds: nothing (this
very record wrote its outcome before a crash or a rebalance), a stored answer, a
shared answer of an identical input, or the LLM — and the task state after it.

Plain data against a `StoreView` (the edge's task store in the worker, a dict in a
test): the at-least-once and exactly-once guarantees rest on these answers, so they
live in one place, apart from how records arrive and are written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, cast

from streams.contract.lanes import Lane, Tier
from streams.contract.records import Source, json_object
from streams.core.cache import ContentCache
from streams.core.outcome import Outcome, Prepared, stored
from streams.core.processor import TaskProcessor
from streams.core.stages import definitions, still_made_of
from streams.core.taskstate import Status, TaskState
from streams.observability.metrics import Metrics

log = logging.getLogger(__name__)

STALE_SAID = 1_000  # earlier definitions of versions warned of, at most (then counted only)


class StoreView(Protocol):
    """What the decisions read of the task store, per task partition."""

    def result(self, partition: int, result_key: str) -> bytes | None: ...

    def dead_letter(self, partition: int, key: str) -> bytes | None: ...

    def state(self, partition: int, task_id: str) -> TaskState | None: ...


@dataclass(frozen=True)
class Asked:
    """How a record asks to be answered (its headers, as the edge read them)."""

    force: bool = False  # a forced replay or a backtrack re-run: ask the LLM again
    tier: Tier | None = None  # a replay's --lane
    note: str | None = None  # for the task's history (backtrack: restored / re-run)


class Ended(StrEnum):
    """How a record's run ended: the `kind` label of `llm_streams_tasks_completed_total`
    and of the end-to-end latency, and the span's `llm_streams.outcome`."""

    RESULT = "result"  # its result written
    DEAD_LETTER = "dead_letter"  # its dead letter written
    ALREADY_DONE = "already_done"  # an earlier run of this very record wrote its outcome
    REROUTED = "rerouted"  # forwarded to its task's partition, answered there
    PARKED = "parked"  # waits in a batch, durably in the ledger (`core.batch.parking`)
    RELEASED = "released"  # its partition is another worker's now: its owner runs it
    ERASED = "erased"  # an erase request (`EraseRequest`): its task's answers erased

    @classmethod
    def of(cls, outcome: Outcome) -> Ended:
        return cls(outcome.kind)


@dataclass(frozen=True)
class Decision:
    """`outcome` to write (None: nothing, an earlier run of this record wrote it), or, for
    an outcome already written, `state` to write when the run that wrote it died before
    writing the task's state."""

    kind: Ended
    outcome: Outcome | None = None
    state: TaskState | None = None
    # With `state`: the outcome that run wrote, whose sink record it may not have.
    written: Outcome | None = None


class Decider:
    def __init__(
        self,
        processor: TaskProcessor,
        store: StoreView,
        cache: ContentCache,
        metrics: Metrics,
        results_topic: str,
    ) -> None:
        self.processor = processor
        self.store = store
        self.cache = cache
        self.metrics = metrics
        self.results_topic = results_topic
        self._stale: set[tuple[str, str, str]] = set()  # earlier definitions said (bounded)

    def dead_letter_written(self, key: str, source: Source) -> bool:
        """Did an earlier run of this very record write its dead letter under `key`?"""
        letter = json_object(self.store.dead_letter(source.partition, key))
        return letter is not None and letter.get("source") == source.model_dump()

    async def decide(self, prep: Prepared, lane: Lane, asked: Asked) -> Decision:
        source, task_id = prep.source, prep.task.task_id
        state = self.store.state(source.partition, task_id)
        if state is not None and state.wrote(source):  # this very record, before a crash
            return Decision(Ended.ALREADY_DONE)
        if state is not None and prep.run is not None and state.ran(prep.run):
            # A second copy of what a replay or a backtrack sent (the command killed before
            # its checkpoint and run again): the first ended the task; forced, it is not
            # asked again, and an older copy does not overwrite a newer answer.
            return Decision(Ended.ALREADY_DONE)
        if self._forwarded_again(state, prep, asked):
            # Its source record forwarded again (its forwarder died before its offset
            # committed): answered once, its sink record written once.
            return Decision(Ended.ALREADY_DONE)
        outcome, written = await self._answer(prep, lane, asked)
        if not written:
            return Decision(Ended.of(outcome), outcome)
        if self._state_missing(state, prep, outcome):
            # Written by a run killed before its state was: write that now.
            return Decision(Ended.ALREADY_DONE, state=self.state_after(outcome, prep, asked.note),
                            written=outcome)  # fmt: skip
        return Decision(Ended.ALREADY_DONE)

    async def _answer(self, prep: Prepared, lane: Lane, asked: Asked) -> tuple[Outcome, bool]:
        """The outcome of a valid task, and whether an earlier run of this very record
        already wrote it. `asked.force` asks the LLM again even when the task or an
        identical input was answered."""
        p, me = prep.source.partition, prep.source.model_dump()
        raw = self.store.result(p, prep.result_key)
        earlier = json_object(raw)
        if raw is not None and earlier is not None:
            if earlier.get("source") == me:
                return stored(prep, "result", prep.result_key, raw, earlier), True
            if not asked.force:  # answered before for another record of the task: no call
                self.metrics.cache_hits.labels(prep.pipeline.name, "result").inc()
                made_under = self._made_under(prep, earlier)
                return self.processor.from_cache(prep, earlier["output"], earlier["model"],
                                                 made_under), False  # fmt: skip
        raw = self.store.dead_letter(p, prep.task.task_id)
        letter = json_object(raw)
        if raw is not None and letter is not None and letter.get("source") == me:
            return stored(prep, "dead_letter", prep.task.task_id, raw, letter), True

        stages = self._earlier_stages(prep)

        async def call() -> tuple[Outcome, tuple[dict[str, Any], str] | None]:
            outcome = await self.processor.answer(prep, lane, stages, asked.tier)
            if outcome.kind == "result" and outcome.output is not None and outcome.model:
                return outcome, (outcome.output, outcome.model)
            return outcome, None

        if asked.force:
            outcome, answer = await call()
            if answer is not None:
                self.cache.put(prep.content_key, *answer)
            return outcome, False
        value, shared = await self.cache.shared(prep.content_key, call)
        if shared:  # an identical input of another task was answered (or in flight)
            output, model = value
            self.metrics.cache_hits.labels(prep.pipeline.name, "content").inc()
            return self.processor.from_cache(prep, output, model), False
        return cast(Outcome, value), False

    def _made_under(self, prep: Prepared, earlier: dict[str, Any]) -> str | None:
        """The definition a stored answer was made under (its `prompt_digest`; None when
        it is older than the field). Another than the version's now: the version was
        edited in place since — the answer is handed out again all the same (a task is
        answered once), counted and said once per earlier definition, with the way to
        answer again (a new version name, or a replay with --force)."""
        said = earlier.get("prompt_digest")
        if not isinstance(said, str):
            return None
        version = prep.version
        if version.made_otherwise(said):
            name = prep.pipeline.name
            self.metrics.stale_answers.labels(name, version.version).inc()
            if (name, version.version, said) not in self._stale and len(self._stale) < STALE_SAID:
                self._stale.add((name, version.version, said))
                log.warning(
                    "pipeline %s version %s was changed since task %s was answered under it "
                    "(definition %s then, %s now): answers already written are kept and "
                    "handed out again, by a replay too; to answer with the changed "
                    "definition, name it as a new version, or replay with --force",
                    name, version.version, prep.task.task_id, said, version.digest,
                )  # fmt: skip
        return said

    def _earlier_stages(self, prep: Prepared) -> dict[str, Any] | None:
        """Answers of the stages an earlier run of this task got before a later stage
        failed, when they are for the same input and version, and made under the stages'
        definitions of now (`stages.still_made_of`)."""
        if not prep.pipeline.stages:
            return None
        state = self.store.state(prep.source.partition, prep.task.task_id)
        if (
            state is None
            or not state.stage_outputs
            or state.input_hash != prep.content_key
            or state.prompt_version != prep.version.version
        ):
            return None
        now = definitions(prep.pipeline, prep.version)
        return still_made_of(state.stage_outputs, state.stage_digests, now) or None

    @staticmethod
    def _forwarded_again(state: TaskState | None, prep: Prepared, asked: Asked) -> bool:
        """The task was ended for the very source record this one was forwarded from."""
        if state is None or prep.origin is None or asked.force:
            return False
        return state.came_from(prep.origin, prep.result_key, prep.version.version)

    @staticmethod
    def _state_missing(state: TaskState | None, prep: Prepared, outcome: Outcome) -> bool:
        want = Status.SUCCEEDED if outcome.kind == "result" else Status.DEAD_LETTERED
        return (
            state is None
            or state.status is not want
            or (outcome.kind == "result" and state.result_key != prep.result_key)
        )

    def state_after(self, outcome: Outcome, prep: Prepared, note: str | None = None) -> TaskState:
        """The task's state once `outcome` (of the record at `prep.source`) is written."""
        source = prep.source
        before = self.store.state(source.partition, prep.task.task_id) or TaskState(
            task_id=prep.task.task_id, status=Status.RECEIVED, updated_at=""
        )
        result = outcome.kind == "result"
        return before.moved(
            Status.SUCCEEDED if result else Status.DEAD_LETTERED,
            note=note or ("cached" if result and outcome.attempts == 0 else None),
            attempts=outcome.attempts,
            input_hash=prep.content_key,
            pipeline=prep.pipeline.name,
            prompt_version=prep.version.version,
            result_key=prep.result_key if result else before.result_key,
            result_topic=self.results_topic if result else before.result_topic,
            result_partition=source.partition if result else before.result_partition,
            source=source,
            origin=prep.origin,
            run=prep.run,
            last_error=None if result else outcome.error,
            stage=outcome.stage,
            stage_outputs=None if result else outcome.stages,
            stage_digests=None if result or not outcome.stages else self._made_of(prep, outcome),
        )

    @staticmethod
    def _made_of(prep: Prepared, outcome: Outcome) -> dict[str, str]:
        """The definitions the stage answers a dead letter keeps were made under: today's
        (an earlier run's were used again only when still current, or when that run, of an
        older release, kept none)."""
        now = definitions(prep.pipeline, prep.version)
        return {name: now[name] for name in outcome.stages or () if name in now}


__all__ = ["Asked", "Decider", "Decision", "StoreView"]
