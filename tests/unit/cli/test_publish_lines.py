"""`llm-streams publish`: each line of a file read as the worker reads a record."""

from __future__ import annotations

import orjson
import pytest

from streams.cli.commands import as_task
from streams.contract.records import BOM


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
