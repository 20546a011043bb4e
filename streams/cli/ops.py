"""Operator commands over the topics: a task's state and history, and dead-letter redrive."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from streams.replay import scan
from streams.settings import Settings
from streams.topics import state_topic

# Dead letters worth sending again once their cause is gone; the others would fail
# the same way (bad input, a request the provider refuses, a wrong key).
REDRIVABLE = ("rate_limited", "timeout", "upstream_error", "circuit_open",
              "deadline_exceeded", "invalid_output")  # fmt: skip
REDRIVE_HEADER = "llm-streams-redrive-of"


async def read_all(settings: Settings, topic: str) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record of `topic` up to its current end (read_committed); a key's records
    in their order."""
    return [record async for batch in scan(settings, topic) for record in batch]


def latest_by_key(records: list[ConsumerRecord[bytes, bytes]]) -> dict[bytes, bytes]:
    latest: dict[bytes, bytes] = {}
    for rec in records:
        if rec.key is not None and rec.value is not None:
            latest[rec.key] = rec.value
    return latest


async def task_state(settings: Settings, task_id: str) -> dict[str, Any] | None:
    """The task's latest state record (status, keys, last error, history), or None."""
    for rec in reversed(await read_all(settings, state_topic(settings))):
        if rec.key == task_id.encode() and rec.value is not None:
            data: dict[str, Any] = orjson.loads(rec.value)
            return data
    return None


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
        category = letter["error"]["category"]
        if category not in categories or category not in REDRIVABLE:
            plan.skipped_category += 1
            continue
        if since is not None and datetime.fromisoformat(letter["failed_at"]) < since:
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
            or (state.get("source") != letter["source"])
        ):
            plan.skipped_answered += 1  # answered since, or re-queued already
            continue
        plan.requeue.append(letter)
    return plan


async def redrive(
    settings: Settings, categories: set[str], since: datetime | None, dry_run: bool
) -> RedrivePlan:
    dead = latest_by_key(await read_all(settings, settings.topics.dead_letters))
    letters = [orjson.loads(v) for v in dead.values()]
    state = latest_by_key(await read_all(settings, state_topic(settings)))
    states = {k.decode(): orjson.loads(v) for k, v in state.items()}
    plan = plan_redrive(letters, states, categories, since)
    if dry_run or not plan.requeue:
        return plan
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, acks="all")
    await producer.start()
    try:
        sent = []
        for letter in plan.requeue:
            task = letter["payload"]
            source = letter["source"]
            origin = f"{source['topic']}/{source['partition']}/{source['offset']}"
            sent.append(await producer.send(
                settings.topics.tasks, key=task["task_id"].encode(), value=orjson.dumps(task),
                headers=[(REDRIVE_HEADER, origin.encode())],
            ))  # fmt: skip
        for fut in sent:
            await fut
    finally:
        await producer.stop()
    return plan
