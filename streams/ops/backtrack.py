"""Backtracking: put tasks back to an earlier answer, or answer them again.

An operator selects tasks from the task-state topic (by ids, pipeline, prompt
version, time of their last change) and either

* restores the result of an earlier prompt version (`restore`): the task is
  sent again pinned to that version; the worker finds that version's result in
  its store and emits it again without an LLM call, and the task's state and
  history say so; or
* re-runs it (`rerun`, optionally under another version): the worker asks the
  LLM again even though an answer exists (same result key when the version
  and input are the same).

The command goes through the worker, as a record on the task's own partition
(the replay lane, header `llm-streams-backtrack`), because the worker owns the
task's state: a write from outside would be overwritten by its next one.

A backtrack is applied once per task: its records carry its id (`backtrack_id`, the
same for the same arguments) and the record each copies, which the worker keeps in
the task's history. Run again (killed half-way, or by mistake), it leaves out a task
whose latest move is its own success, and the worker ends nothing twice for a copy still
on its way (`core.taskstate.TaskState.ran`): a re-run is paid once. A task that moved
since (a new record answered), or that it left dead-lettered, is sent again.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import orjson
from aiokafka import TopicPartition

from streams.contract.headers import BACKTRACK_HEADER, REPLAY_ID_HEADER, REPLAY_OF_HEADER
from streams.contract.records import decode_task, result_key, stored_time
from streams.core.taskstate import sent_by_run
from streams.errors import ConfigError, TaskError
from streams.kafka import clients
from streams.kafka.clients import reader
from streams.kafka.publisher import Sends
from streams.kafka.scan import end_offsets, scan_latest
from streams.kafka.topics import ensure_topics, state_topic
from streams.ops.replay import read_answered
from streams.pipelines.registry import PipelineRegistry
from streams.settings import Settings

Action = Literal["restore", "rerun"]


@dataclass(frozen=True)
class Selection:
    """Which tasks: every given criterion must hold (none given: refused)."""

    task_ids: frozenset[str] = frozenset()
    pipeline: str | None = None
    prompt_version: str | None = None  # the version of the task's current answer
    since: datetime | None = None  # last change at or after
    until: datetime | None = None  # last change before

    def empty(self) -> bool:
        return not (self.task_ids or self.pipeline or self.prompt_version or self.since
                    or self.until)  # fmt: skip

    def matches(self, state: dict[str, Any]) -> bool:
        if self.task_ids and state.get("task_id") not in self.task_ids:
            return False
        if self.pipeline and state.get("pipeline") != self.pipeline:
            return False
        if self.prompt_version and state.get("prompt_version") != self.prompt_version:
            return False
        if self.since or self.until:
            at = stored_time(state.get("updated_at"))
            if at is None:
                return False
            if self.since and at < self.since:
                return False
            if self.until and at >= self.until:
                return False
        return True


def backtrack_id(selection: Selection, action: Action, version: str | None) -> str:
    """Same arguments, same id: what the worker knows this backtrack's records by."""
    parts = [
        action,
        version or "",
        ",".join(sorted(selection.task_ids)),
        selection.pipeline or "",
        selection.prompt_version or "",
        selection.since.isoformat() if selection.since else "",
        selection.until.isoformat() if selection.until else "",
    ]
    return "bt-" + hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


@dataclass
class Plan:
    sent: int = 0  # tasks sent (with a dry run: that would be)
    # Left out: this very backtrack (the same arguments) put them back, and they have
    # not moved since (it was run again).
    done: list[str] = field(default_factory=list)
    no_source: list[str] = field(default_factory=list)  # state without a readable record
    no_result: list[str] = field(default_factory=list)  # restore: that version never answered
    missing_ids: list[str] = field(default_factory=list)  # asked for, no state at all
    # its version (the one asked for, else the task's own) not in its pipeline, and why
    no_version: list[str] = field(default_factory=list)
    version_refused: str = ""
    refused: str = ""  # records the replay topic or the producer refused for good, said


# Tasks whose records are read and sent at a time: what a backtrack holds of them, however
# many it selects (a pipeline's year of tasks held every task and state whole at once).
READ_AT_ONCE = 5_000


async def latest_states(
    settings: Settings,
    selection: Selection,
    restored: str | None = None,
    run_id: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Of each task `selection` names or matches, what the backtrack needs of its latest
    state: its task id, where its record is (`source`, when known), when `restored` is
    given whether its history says that version answered it (`answered`), and whether its
    latest move was the backtrack `run_id`'s (`done`); a task named that does not match:
    its id alone (it is not missing)."""

    def chosen(state: dict[str, Any]) -> dict[str, Any] | None:
        task_id = state.get("task_id")
        if not isinstance(task_id, str):
            return None
        if not selection.matches(state):
            return {"task_id": task_id} if task_id in selection.task_ids else None
        kept: dict[str, Any] = {"task_id": task_id, "chosen": True}
        source = state.get("source")
        if isinstance(source, dict):
            kept["source"] = (source.get("topic"), source.get("partition"), source.get("offset"))
        if restored is not None:
            kept["answered"] = _history_answered(state, restored)
        if run_id is not None and _moved_last_by(state, run_id):
            kept["done"] = True
        return kept

    named = {t.encode() for t in selection.task_ids} if selection.task_ids else None
    found = await scan_latest(settings, state_topic(settings), keys=named, shape=chosen)
    return {k.decode(errors="replace"): v for k, v in found.items()}


async def read_at(
    settings: Settings, sources: list[tuple[str, int, int]]
) -> dict[tuple[str, int, int], bytes | None]:
    """The values of records at exact (topic, partition, offset) positions."""
    wanted: dict[TopicPartition, set[int]] = defaultdict(set)
    for topic, partition, offset in sources:
        wanted[TopicPartition(topic, partition)].add(offset)
    found: dict[tuple[str, int, int], bytes | None] = {}
    consumer = reader(settings, "backtrack", max_poll_records=500)
    await consumer.start()
    try:
        ends = await end_offsets(consumer, list(wanted))
        for tp, offsets in wanted.items():
            todo = {o for o in offsets if o < ends[tp]}
            if not todo:
                continue
            consumer.seek(tp, min(todo))
            last = max(todo)
            while todo and await consumer.position(tp) <= last:
                batch = await consumer.getmany(tp, timeout_ms=1000)
                for r in batch.get(tp, []):
                    if r.offset in todo:
                        found[(tp.topic, tp.partition, r.offset)] = r.value
                        todo.discard(r.offset)
                if not batch and await consumer.position(tp) >= ends[tp]:
                    break  # the rest were compacted or deleted
    finally:
        await consumer.stop()
    return found


async def backtrack(
    settings: Settings,
    registry: PipelineRegistry,
    selection: Selection,
    action: Action,
    version: str | None,
    *,
    dry_run: bool = False,
) -> Plan:
    """Send each selected task into the replay lane (with `dry_run`, count them), its
    records read and sent `READ_AT_ONCE` at a time in the order they were written."""
    if selection.empty():
        raise ConfigError("select tasks: give task ids, --pipeline, --version, --since or --until")
    if action == "restore" and version is None:
        raise ConfigError("restore needs the prompt version to restore (--to-version)")
    run_id = backtrack_id(selection, action, version)
    states = await latest_states(settings, selection, version if action == "restore" else None,
                                 run_id)  # fmt: skip
    plan = Plan(missing_ids=sorted(selection.task_ids - set(states)))
    plan.done = sorted(s["task_id"] for s in states.values() if s.get("done"))
    chosen = [s for s in states.values() if s.get("chosen") and not s.get("done")]
    plan.no_source = [s["task_id"] for s in chosen if not _position(s.get("source"))]
    where = sorted((s["source"], s["task_id"], s.get("answered", False)) for s in chosen
                   if _position(s.get("source")))  # fmt: skip
    del states, chosen
    keys = set()
    if action == "restore":
        keys = (await read_answered(settings, selection.pipeline, version)).keys
    run = _Run(settings, registry, action, version, run_id, keys, plan)
    if dry_run or not where:
        await run.each(where, None)
    else:
        await ensure_topics(settings, [settings.topics.replay])
        idempotent = settings.kafka.idempotent_producer
        producer = clients.producer(settings, acks="all", enable_idempotence=idempotent)
        await producer.start()
        try:
            sends = Sends(producer)
            await run.each(where, sends)
            plan.sent, plan.refused = sends.acked, sends.said()
        finally:
            await producer.stop()
    for skipped in (plan.no_source, plan.no_result, plan.no_version):
        skipped.sort()
    return plan


def _position(source: Any) -> bool:
    """Is `source` where a record is: (topic, partition, offset)?"""
    return (
        isinstance(source, tuple)
        and isinstance(source[0], str)
        and all(isinstance(n, int) and not isinstance(n, bool) for n in source[1:])
    )


@dataclass
class _Run:
    settings: Settings
    registry: PipelineRegistry
    action: Action
    version: str | None
    run_id: str  # `backtrack_id`
    keys: set[bytes]  # a restore's: the results topic's keys
    plan: Plan

    async def each(
        self, where: list[tuple[tuple[str, int, int], str, bool]], sends: Sends | None
    ) -> None:
        """Each task at its place in `where` sent (without `sends`: counted)."""
        for at in range(0, len(where), READ_AT_ONCE):
            part = where[at : at + READ_AT_ONCE]
            values = await read_at(self.settings, [source for source, _, _ in part])
            for source, task_id, answered in part:
                planned = self.planned(task_id, values.get(source), answered)
                if planned is None:
                    continue
                if sends is None:
                    self.plan.sent += 1
                    continue
                value, key = planned
                origin = "/".join(str(x) for x in source).encode()
                await sends.send(task_id, self.settings.topics.replay, key=key, value=value,
                                 headers=[(BACKTRACK_HEADER, self.action.encode()),
                                          (REPLAY_ID_HEADER, self.run_id.encode()),
                                          (REPLAY_OF_HEADER, origin)])  # fmt: skip
            if sends is not None:
                await sends.wait()

    def planned(
        self, task_id: str, raw: bytes | None, history_answered: bool
    ) -> tuple[bytes, bytes] | None:
        """The task record to send for `task_id` (its value and key), or None with the
        reason put in the plan. A restore sends only a task its version answered: its
        result key says so; a session turn's key holds its context's digest, so for it the
        task's history (`history_answered`) says so."""
        try:
            task = decode_task(raw, max_bytes=self.settings.batch.max_task_bytes)
            pipeline = self.registry.get(task.pipeline)
        except TaskError:
            self.plan.no_source.append(task_id)
            return None
        session = pipeline.session_of(task)
        try:
            target = pipeline.version(self.version or task.prompt_version,
                                      session or task.task_id)  # fmt: skip
        except TaskError as exc:  # no such version: this task is left, the others go
            self.plan.no_version.append(task_id)
            self.plan.version_refused = self.plan.version_refused or str(exc)
            return None
        if self.action == "restore" and not (
            history_answered
            or result_key(pipeline.name, target.version, task.task_id, task.input).encode()
            in self.keys
        ):
            self.plan.no_result.append(task_id)
            return None
        value = task.model_dump(mode="json", exclude_none=True)
        value["prompt_version"] = target.version
        return orjson.dumps(value), (session or task_id).encode()


def _moved_last_by(state: dict[str, Any], run_id: str) -> bool:
    """Was the task's latest move a success of a record the backtrack `run_id` sent? (One
    that ended in a dead letter — the endpoint down — is sent again: run again, the
    backtrack tries it again.)"""
    history = state.get("history")
    last = history[-1] if isinstance(history, list) and history else None
    if not isinstance(last, dict) or last.get("status") != "succeeded":
        return False
    return sent_by_run(last.get("run"), run_id)


def _history_answered(state: dict[str, Any], version: str) -> bool:
    """Does the task's history say `version` answered it?"""
    return any(
        isinstance(h, dict)
        and h.get("prompt_version") == version
        and h.get("result_key")
        and h.get("status") == "succeeded"
        for h in state.get("history") or []
    )


__all__ = [
    "Plan",
    "Selection",
    "backtrack",
    "backtrack_id",
    "latest_states",
    "read_at",
]
