"""Operator commands over the topics: a task's state and history, and dead-letter redrive."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from aiokafka.structs import ConsumerRecord

from streams.contract.headers import REDRIVE_HEADER
from streams.errors import REDRIVABLE
from streams.kafka import clients
from streams.kafka.scan import latest_objects, scan
from streams.kafka.topics import state_topic
from streams.settings import Settings


async def read_all(settings: Settings, topic: str) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record of `topic` up to its current end (read_committed); a key's records
    in their order."""
    return [record async for batch in scan(settings, topic) for record in batch]


async def task_state(settings: Settings, task_id: str) -> dict[str, Any] | None:
    """The task's latest state record (status, keys, last error, history), or None."""
    key = task_id.encode()
    return latest_objects(r for r in await read_all(settings, state_topic(settings))
                          if r.key == key).get(key)  # fmt: skip


@dataclass
class RedrivePlan:
    requeue: list[dict[str, Any]]  # dead letters to send again
    skipped_category: int = 0
    skipped_answered: int = 0
    skipped_not_a_task: int = 0
    skipped_before: int = 0


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
        error = letter.get("error")
        category = error.get("category") if isinstance(error, dict) else None
        if category not in categories or category not in REDRIVABLE:
            plan.skipped_category += 1
            continue
        if since is not None and _failed_before(letter, since):
            plan.skipped_before += 1
            continue
        payload = letter.get("payload")
        if not isinstance(payload, dict) or not isinstance(payload.get("task_id"), str):
            plan.skipped_not_a_task += 1
            continue
        state = states.get(payload["task_id"])
        if (
            state is None
            or state.get("status") != "dead_lettered"
            or (state.get("source") != letter.get("source"))
        ):
            plan.skipped_answered += 1  # answered since, or re-queued already
            continue
        plan.requeue.append(letter)
    return plan


def _failed_before(letter: dict[str, Any], since: datetime) -> bool:
    try:
        return datetime.fromisoformat(str(letter.get("failed_at"))) < since
    except ValueError:
        return False


async def redrive(
    settings: Settings, categories: set[str], since: datetime | None, dry_run: bool
) -> RedrivePlan:
    letters = list(latest_objects(await read_all(settings, settings.topics.dead_letters)).values())
    states = {k.decode(errors="replace"): v for k, v in
              latest_objects(await read_all(settings, state_topic(settings))).items()}  # fmt: skip
    plan = plan_redrive(letters, states, categories, since)
    if dry_run or not plan.requeue:
        return plan
    producer = clients.producer(settings, acks="all")
    await producer.start()
    try:
        sent = []
        for letter in plan.requeue:
            task = letter["payload"]
            source = letter.get("source") or {}
            origin = f"{source.get('topic')}/{source.get('partition')}/{source.get('offset')}"
            sent.append(await producer.send(
                settings.topics.tasks, key=task["task_id"].encode(), value=orjson.dumps(task),
                headers=[(REDRIVE_HEADER, origin.encode())],
            ))  # fmt: skip
        for fut in sent:
            await fut
    finally:
        await producer.stop()
    return plan
