"""`llm-streams publish`: each line of a file read as the worker reads a record."""

from __future__ import annotations

import io
from typing import Any

import orjson
import pytest

from streams.cli.commands import as_task
from streams.contract.records import BOM
from streams.kafka.publisher import Sends, TaskPublisher
from streams.settings import load_settings


def test_a_line_with_an_integer_beyond_64_bits_is_refused_not_published_changed() -> None:
    """orjson reads such an integer as a double: published as read, the task carried
    another number than the file's (the worker's own check never saw the original)."""
    with pytest.raises(orjson.JSONDecodeError, match="beyond 64 bits"):
        as_task(b'{"text": "order 1", "order": 18446744073709551616}\n', "comment-analysis")
    task = as_task(b'{"text": "order 1", "order": 18446744073709551615}\n', "comment-analysis")
    assert task == {"input": {"text": "order 1", "order": 18446744073709551615},
                    "pipeline": "comment-analysis"}  # fmt: skip


def test_a_first_line_after_a_byte_order_mark_is_read() -> None:
    """A file a Windows tool wrote starts with a UTF-8 byte order mark: its first line is a
    task like the others, as the worker reads such a record."""
    task = as_task(BOM + b'{"task_id": "t-1", "input": {"text": "ok"}}\n', "comment-analysis")
    assert task == {"task_id": "t-1", "input": {"text": "ok"}, "pipeline": "comment-analysis"}


class Builds:
    """A TaskPublisher that validates each line as the real one and sends nothing."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    async def __aenter__(self) -> Builds:
        return self

    async def __aexit__(self, *_: Any) -> None:
        return None

    def sends(self) -> Sends:
        return Sends(None)  # type: ignore[arg-type]

    async def publish(self, data: dict[str, Any], **_: Any) -> Any:
        return TaskPublisher.build(data)


async def test_a_refused_line_is_said_as_text_whatever_brackets_it_holds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The refusal quotes the line's values: "[/x]" in one was a MarkupError that ended
    # the publish, the lines after it never read.
    import streams.cli.commands as commands

    async def no_topics(*_: Any) -> None:
        return None

    monkeypatch.setattr(commands, "TaskPublisher", Builds)
    monkeypatch.setattr(commands, "ensure_topics", no_topics)
    lines = b'{"task_id": "[/x] y", "input": "[/bold] not an object"}\n{"text": "fine"}\n'
    _, bad, _ = await commands.publish_lines(load_settings(), io.BytesIO(lines),
                                                pipeline="comment-analysis", topic=None)  # fmt: skip
    assert bad == 1
    assert "[/bold] not an object" in capsys.readouterr().err.replace("\n", "")
