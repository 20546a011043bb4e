"""Log lines: JSON or text, with the task in hand, never a secret or personal data."""

from __future__ import annotations

import asyncio
import logging

import orjson

from streams.observability.logs import JsonLines, ScrubbedText, TaskContext, current_task_id

KEY = "sk-proj-LEAKCHECK-0123456789"


def record(message: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError(f"payload had {KEY} and li.lei@example.com")
        except ValueError as e:
            exc_info = (type(e), e, e.__traceback__)
    r = logging.LogRecord("streams.test", logging.WARNING, __file__, 1, message, args, exc_info)
    TaskContext().filter(r)
    return r


async def test_json_lines_carry_the_task_and_hide_keys_and_pii() -> None:
    async def job() -> str:
        current_task_id.set("task-42")
        message = "call with %s failed for 13812345678 / %s"
        return JsonLines([KEY]).format(record(message, KEY, "4111 1111 1111 1111", exc=True))

    line = await asyncio.create_task(job())
    entry = orjson.loads(line)
    assert entry["task_id"] == "task-42" and entry["level"] == "warning"
    assert entry["message"] == "call with [SECRET] failed for [PHONE] / [BANK_CARD]"
    assert KEY not in line and "li.lei@example.com" not in line and "[EMAIL]" in entry["exc"]
    # Outside a job there is no task.
    assert orjson.loads(JsonLines([KEY]).format(record("idle")))["task_id"] is None


def test_text_lines_are_scrubbed_too() -> None:
    line = ScrubbedText([KEY]).format(record("key %s, mail a.b@c.io", KEY))
    assert KEY not in line and "a.b@c.io" not in line and "[SECRET]" in line
