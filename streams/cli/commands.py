"""publish and tail: the CLI on top of TaskPublisher and a plain consumer."""

from __future__ import annotations

import asyncio
import io
import os
import uuid
from typing import IO, Any

import orjson
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from streams.contract.records import record_json
from streams.errors import InvalidInput
from streams.kafka import clients
from streams.kafka.publisher import TaskPublisher
from streams.kafka.topics import ensure_topics
from streams.ops.render import describe
from streams.settings import Settings


def as_task(line: bytes, pipeline: str) -> dict[str, Any]:
    """A task dict from a JSON line that is either a task or its bare `input`, read as
    the worker reads a record (`record_json`: past a byte order mark; an integer beyond
    64 bits refused, not published as another number)."""
    data = record_json(line)
    if not isinstance(data, dict):
        raise InvalidInput("line is not a JSON object")
    if "input" not in data:
        data = {"input": data}
    data.setdefault("pipeline", pipeline)
    return data


# Lines whose sends are waited for together: what a publish holds in flight, whatever the
# size of the file it reads (it read the file whole into memory and never looked at the
# sends' answers, saying "published" of a task the broker had refused).
WAIT_EVERY = 1_000


async def publish_lines(
    settings: Settings, source: IO[bytes], *, pipeline: str, topic: str | None
) -> tuple[int, int, str]:
    """Publish each line of `source` as a task, read line by line: (tasks acked, lines
    that are no task, the refusals for good said — the line numbers — or "")."""
    await ensure_topics(settings, [topic or settings.topics.tasks])
    console = Console(stderr=True)
    bad = 0
    columns = (TextColumn("publishing"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    async with TaskPublisher(settings, topic=topic) as pub:
        sends = pub.sends()
        with Progress(*columns, console=console, transient=True) as progress:
            bar = progress.add_task("publish", total=_size(source))
            for number, line in enumerate(source, 1):
                progress.advance(bar, len(line))
                if not line.strip():
                    continue
                try:
                    await pub.publish(as_task(line, pipeline), sends=sends, name=f"line {number}")
                except (InvalidInput, orjson.JSONDecodeError) as exc:
                    bad += 1
                    console.print(f"[red]line {number}: {escape(str(exc))}[/red]")
                if number % WAIT_EVERY == 0:
                    await sends.wait()
            await sends.wait()
    return sends.acked, bad, sends.said()


def _size(source: IO[bytes]) -> int | None:
    """The bytes left to read of a file; None for a pipe or a terminal."""
    try:
        return os.fstat(source.fileno()).st_size - source.tell() if source.seekable() else None
    except (OSError, ValueError, io.UnsupportedOperation):
        return None


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
