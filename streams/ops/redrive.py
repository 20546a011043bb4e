"""Operator commands over the topics: a task's state and history, and dead-letter redrive."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from streams.contract.headers import REDRIVE_HEADER
from streams.contract.records import stored_time
from streams.errors import REDRIVABLE
from streams.kafka import clients
from streams.kafka.clients import partitions_of
from streams.kafka.publisher import Sends
from streams.kafka.routing import partition_for, task_key
from streams.kafka.scan import scan_latest
from streams.kafka.topics import state_topic
from streams.settings import Settings


async def task_state(settings: Settings, task_id: str) -> dict[str, Any] | None:
    """The task's latest state record (status, keys, last error, history), or None. Its
    partition is the one its task id maps to, unless the task is in a session (then its
    session's): that one is read first, the others only when the state is not there."""
    key, topic = task_id.encode(), state_topic(settings)
    parts = await partitions_of(settings, topic)
    if not parts:
        return None
    home = {partition_for(task_id, len(parts))}
    found = await scan_latest(settings, topic, keys={key}, partitions=home)
    if key not in found:
        rest = set(parts) - home
        found = await scan_latest(settings, topic, keys={key}, partitions=rest) if rest else {}
    return found.get(key)


@dataclass
class RedrivePlan:
    requeue: list[dict[str, Any]]  # dead letters to send again
    skipped_category: int = 0
    skipped_answered: int = 0
    skipped_not_a_task: int = 0
    skipped_before: int = 0
    sent: int = 0  # acked (a dry run: none)
    refused: str = ""  # records the tasks topic or the producer refused for good, said


def plan_redrive(
    letters: list[dict[str, Any]],
    states: dict[str, dict[str, Any]],
    categories: set[str],
    since: datetime | None,
) -> RedrivePlan:
    """Which dead letters to re-queue: a retryable category asked for, failed since
    `since`, a real task (not bad input), and still the task's latest state."""
    plan = RedrivePlan(requeue=[])
    for letter in letters:
        category = _category(letter)
        if category not in categories or category not in REDRIVABLE:
            plan.skipped_category += 1
            continue
        if since is not None and _failed_before(letter, since):
            plan.skipped_before += 1
            continue
        task_id = _task_id(letter)
        if task_id is None:
            plan.skipped_not_a_task += 1
            continue
        state = states.get(task_id)
        if (
            state is None
            or state.get("status") != "dead_lettered"
            or (state.get("source") != letter.get("source"))
        ):
            plan.skipped_answered += 1  # answered since, or re-queued already
            continue
        plan.requeue.append(letter)
    return plan


def _category(letter: dict[str, Any]) -> Any:
    error = letter.get("error")
    return error.get("category") if isinstance(error, dict) else None


def _task_id(letter: dict[str, Any]) -> str | None:
    """The task id of a dead letter whose payload is a task, else None (bad input)."""
    payload = letter.get("payload")
    task_id = payload.get("task_id") if isinstance(payload, dict) else None
    return task_id if isinstance(task_id, str) else None


def _failed_before(letter: dict[str, Any], since: datetime) -> bool:
    failed_at = stored_time(letter.get("failed_at"))
    return failed_at is not None and failed_at < since


async def redrive(
    settings: Settings, categories: set[str], since: datetime | None, dry_run: bool
) -> RedrivePlan:
    # Only what may be sent again is kept whole: the letters of the categories asked for
    # (of the others, their category), then the states of their tasks alone — the topics
    # hold every task the worker ever saw.
    def asked(letter: dict[str, Any]) -> dict[str, Any]:
        category = _category(letter)
        return letter if category in categories else {"error": {"category": category}}

    found = await scan_latest(settings, settings.topics.dead_letters, shape=asked)
    letters = list(found.values())
    wanted = {t.encode() for t in map(_task_id, letters) if t is not None}
    stored = await scan_latest(settings, state_topic(settings), keys=wanted)
    states = {k.decode(errors="replace"): v for k, v in stored.items()}
    plan = plan_redrive(letters, states, categories, since)
    if dry_run or not plan.requeue:
        return plan
    producer = clients.producer(settings, acks="all")
    await producer.start()
    try:
        sends = Sends(producer)
        for letter in plan.requeue:
            task = letter["payload"]
            source = letter.get("source") or {}
            origin = f"{source.get('topic')}/{source.get('partition')}/{source.get('offset')}"
            task_id: str = task["task_id"]
            session = task.get("session_id")
            key = task_key(task_id, session if isinstance(session, str) else None)
            await sends.send(task_id, settings.topics.tasks, key=key,
                             value=orjson.dumps(task),
                             headers=[(REDRIVE_HEADER, origin.encode())])  # fmt: skip
        await sends.wait()
        plan.sent, plan.refused = sends.acked, sends.said()
    finally:
        await producer.stop()
    return plan
