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
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import orjson
from aiokafka import TopicPartition

from streams.contract.headers import BACKTRACK_HEADER, REPLAY_OF_HEADER
from streams.contract.records import decode_task, result_key
from streams.errors import ConfigError, TaskError
from streams.kafka import clients
from streams.kafka.clients import reader
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
            try:
                at = datetime.fromisoformat(state["updated_at"])
            except (KeyError, ValueError):
                return False
            if self.since and at < self.since:
                return False
            if self.until and at >= self.until:
                return False
        return True


@dataclass
class Plan:
    # (task_id, task JSON, record key: the task's, or its session's, and where the task's
    # record was: the worker rebuilds a session turn's context from the turns before it)
    send: list[tuple[str, bytes, bytes, bytes]] = field(default_factory=list)
    no_source: list[str] = field(default_factory=list)  # state without a readable record
    no_result: list[str] = field(default_factory=list)  # restore: that version never answered
    missing_ids: list[str] = field(default_factory=list)  # asked for, no state at all


async def latest_states(settings: Settings, selection: Selection) -> dict[str, dict[str, Any]]:
    """The latest state of each task `selection` names or matches: whole when it matches,
    its task id alone when it was named and does not (it is not missing)."""

    def chosen(state: dict[str, Any]) -> dict[str, Any] | None:
        task_id = state.get("task_id")
        if not isinstance(task_id, str):
            return None
        if selection.matches(state):
            return state
        return {"task_id": task_id} if task_id in selection.task_ids else None

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


async def plan_backtrack(
    settings: Settings,
    registry: PipelineRegistry,
    selection: Selection,
    action: Action,
    version: str | None,
) -> Plan:
    """What to send for each selected task (nothing is sent here)."""
    if selection.empty():
        raise ConfigError("select tasks: give task ids, --pipeline, --version, --since or --until")
    if action == "restore" and version is None:
        raise ConfigError("restore needs the prompt version to restore (--to-version)")
    states = await latest_states(settings, selection)
    plan = Plan(missing_ids=sorted(selection.task_ids - set(states)))
    chosen = [s for s in states.values() if selection.matches(s) and s.get("source")]
    plan.no_source = sorted(s["task_id"] for s in states.values()
                            if selection.matches(s) and not s.get("source"))  # fmt: skip
    where = {s["task_id"]: (s["source"]["topic"], s["source"]["partition"],
                            s["source"]["offset"]) for s in chosen}  # fmt: skip
    values = await read_at(settings, list(where.values()))
    keys: set[bytes] = set()
    if action == "restore":
        keys = (await read_answered(settings)).keys
    for task_id, source in sorted(where.items()):
        raw = values.get(source)
        try:
            task = decode_task(raw, max_bytes=settings.batch.max_task_bytes)
            pipeline = registry.get(task.pipeline)
        except TaskError:
            plan.no_source.append(task_id)
            continue
        session = pipeline.session_of(task)
        try:
            target = pipeline.version(version or task.prompt_version, session or task.task_id)
        except TaskError as exc:  # the version asked for does not exist: say so, send nothing
            raise ConfigError(str(exc)) from None
        if action == "restore" and not _answered(states[task_id], task, pipeline.name,
                                                 target.version, keys):  # fmt: skip
            plan.no_result.append(task_id)
            continue
        value = task.model_dump(mode="json", exclude_none=True)
        value["prompt_version"] = target.version
        origin = "/".join(str(x) for x in source).encode()
        plan.send.append((task_id, orjson.dumps(value), (session or task_id).encode(), origin))
    return plan


def _answered(
    state: dict[str, Any], task: Any, pipeline: str, version: str, keys: set[bytes]
) -> bool:
    """Was the task answered under `version`? Its result key says so; a session turn's
    key holds its context's digest, so for it the task's history says so."""
    if result_key(pipeline, version, task.task_id, task.input).encode() in keys:
        return True
    return any(
        h.get("prompt_version") == version
        and h.get("result_key")
        and h.get("status") == "succeeded"
        for h in state.get("history") or []
    )


async def send_backtrack(settings: Settings, plan: Plan, action: Action) -> int:
    """Send the planned records into the replay lane; return how many."""
    if not plan.send:
        return 0
    await ensure_topics(settings, [settings.topics.replay])
    producer = clients.producer(settings, acks="all",
                                enable_idempotence=settings.kafka.idempotent_producer)  # fmt: skip
    await producer.start()
    try:
        pending = [
            await producer.send(
                settings.topics.replay, key=key, value=value,
                headers=[(BACKTRACK_HEADER, action.encode()), (REPLAY_OF_HEADER, origin)],
            )
            for _, value, key, origin in plan.send
        ]  # fmt: skip
        for sent in pending:
            await sent
    finally:
        await producer.stop()
    return len(plan.send)


__all__ = [
    "Plan",
    "Selection",
    "latest_states",
    "plan_backtrack",
    "read_at",
    "send_backtrack",
]
