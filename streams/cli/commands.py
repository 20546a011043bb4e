"""publish and tail: the CLI on top of TaskPublisher and a plain consumer."""

from __future__ import annotations

import asyncio
import uuid
from typing import IO, Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from streams.errors import InvalidInput
from streams.kafka import clients
from streams.kafka.publisher import TaskPublisher
from streams.kafka.topics import ensure_topics
from streams.ops.render import describe
from streams.settings import Settings


def as_task(line: bytes, pipeline: str) -> dict[str, Any]:
    """A task dict from a JSON line that is either a task or its bare `input`."""
    data = orjson.loads(line)
    if not isinstance(data, dict):
        raise InvalidInput("line is not a JSON object")
    if "input" not in data:
        data = {"input": data}
    data.setdefault("pipeline", pipeline)
    return data


async def publish_lines(
    settings: Settings, source: IO[bytes], *, pipeline: str, topic: str | None
) -> tuple[int, int]:
    lines = [ln for ln in source.read().splitlines() if ln.strip()]
    await ensure_topics(settings, [topic or settings.topics.tasks])
    console = Console(stderr=True)
    sent = bad = 0
    columns = (TextColumn("publishing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    async with TaskPublisher(settings, topic=topic) as pub:
        with Progress(*columns, console=console, transient=True) as progress:
            bar = progress.add_task("publish", total=len(lines))
            for number, line in enumerate(lines, 1):
                try:
                    await pub.publish(as_task(line, pipeline), wait=False)
                    sent += 1
                except (InvalidInput, orjson.JSONDecodeError) as exc:
                    bad += 1
                    console.print(f"[red]line {number}: {exc}[/red]")
                progress.advance(bar)
            await pub.flush()
    return sent, bad


async def tail_topic(
    settings: Settings, topic: str, from_beginning: bool, max_records: int, idle_timeout: float
) -> None:
    console = Console()
    consumer = clients.consumer(
        settings,
        topic,
        purpose="tail",
        group_id=f"llm-streams-tail-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest" if from_beginning else "latest",
        enable_auto_commit=False,
    )
    await consumer.start()
    seen = 0
    try:
        while True:
            batch = await consumer.getmany(timeout_ms=int((idle_timeout or 1.0) * 1000))
            if not batch and idle_timeout:
                return
            for records in batch.values():
                for rec in records:
                    console.print(describe(rec.topic, rec.key, rec.value), highlight=False)
                    seen += 1
                    if max_records and seen >= max_records:
                        return
            await asyncio.sleep(0)
    finally:
        await consumer.stop()
